import json

import numpy as np
import pytest

from scheduler.cost_model import CostModel, HardwareProfile, ModelShape
from scheduler.errors import ProfileError, UnknownNameError
from scheduler.model_shapes import MODEL_SHAPES
from tests.scheduler.factories import h200_8b, toy_cost


def test_llama_3_8b_parameter_count_matches_the_published_8_03_billion():
    assert ModelShape.named("llama-3-8b").params == 8_030_261_248


def test_tied_embeddings_are_counted_once():
    cfg = dict(MODEL_SHAPES["smollm2-135m"])
    tied = ModelShape.from_hf_config(cfg).params
    untied = ModelShape.from_hf_config({**cfg, "tie_word_embeddings": False}).params
    assert untied - tied == cfg["vocab_size"] * cfg["hidden_size"]


def test_qwen2_attention_biases_are_counted():
    shape = ModelShape.named("qwen2.5-7b")
    assert 7.6e9 < shape.params < 7.7e9


def test_kv_bytes_per_token_is_two_tensors_per_layer():
    assert ModelShape.named("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_h200_leaves_about_110_gb_for_llama_3_8b_kv():
    assert 105e9 < h200_8b().kv_capacity_bytes < 115e9


def test_unknown_names_raise_a_typed_error_listing_the_known_ones():
    with pytest.raises(UnknownNameError, match="h200"):
        HardwareProfile.named("tpu")
    with pytest.raises(UnknownNameError, match="llama-3-8b"):
        ModelShape.named("gpt-5")


def test_measured_profile_is_read_from_the_runtime_json(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(
        json.dumps(
            {
                "name": "measured",
                "flops": 2e11,
                "bandwidth_bytes_per_s": 5e10,
                "kv_capacity_bytes": 1_000_000,
            }
        )
    )
    hw = HardwareProfile.from_json(path)
    assert (hw.flops, hw.bandwidth, hw.kv_capacity_bytes, hw.batch_multiple) == (
        2e11,
        5e10,
        1_000_000,
        1,
    )


def test_a_profile_file_without_bandwidth_is_rejected(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"name": "measured", "flops": 1e12}))
    with pytest.raises(ProfileError):
        HardwareProfile.from_json(path)


def test_comp_and_mem_follow_the_design_formulas():
    cm = toy_cost()  # P = 1e6 → 2e6 FLOP/token at 1e12 FLOP/s; 1 KiB of KV per token at 1e12 B/s
    assert cm.comp(100, 10) == pytest.approx(110 * 2e6 / 1e12)
    assert cm.mem(100, 10) == pytest.approx((100 * 10 + 10 * 10 / 2) * 1024 / 1e12)
    assert cm.rho(100, 10) == pytest.approx(cm.comp(100, 10) / cm.mem(100, 10))


def test_rho_of_a_request_without_decode_is_infinite():
    assert h200_8b().rho(100, 0) == float("inf")
    assert np.isinf(h200_8b().rho(np.array([100]), np.array([0]))[0])


def test_array_inputs_give_the_same_numbers_as_scalars():
    cm = h200_8b()
    p, d = np.array([10, 500]), np.array([3, 2000])
    assert np.allclose(cm.mem(p, d), [cm.mem(10, 3), cm.mem(500, 2000)])


def test_step_time_overlaps_or_adds_compute_and_memory():
    cm = toy_cost()
    c, m = cm.step_compute_time(1000), cm.step_memory_time(5000)
    assert cm.step_time(1000, 5000) == pytest.approx(max(c, m))
    assert cm.step_time(1000, 5000, overlap=False) == pytest.approx(c + m)


def test_optimal_makespan_discounts_compute_by_the_sharing_ratio():
    assert CostModel.default().optimal_makespan(10.0, 4.0, 0.5) == 5.0
    assert CostModel.default().optimal_makespan(10.0, 6.0, 0.5) == 6.0
