import json

import numpy as np
import pytest

from scheduler.cost_model import CostModel, HardwareProfile, ModelShape, min_steps
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


def test_a_datasheet_profile_file_is_read(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"name": "measured", "flops": 2e11, "bandwidth_bytes_per_s": 5e10,
                                "kv_capacity_bytes": 1_000_000}))
    hw = HardwareProfile.from_json(path)
    assert (hw.flops, hw.bandwidth, hw.kv_capacity_bytes, hw.batch_multiple) == (
        2e11, 5e10, 1_000_000, 1)
    assert hw.overlap == 0.0 and hw.measured is None


def test_a_measured_step_model_replaces_the_datasheet_coefficients(tmp_path):
    step = {"step_fixed_s": 0.05, "s_per_token": 0.002, "s_per_row": 0.001,
            "s_per_pair": 5e-7, "s_per_kv_token": 1e-5}
    cfg = dict(MODEL_SHAPES["smollm2-135m"], torch_dtype="float32")
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"name": "measured:m@cpu", "flops": 1e11, "bandwidth_bytes_per_s": 4e9,
                                "overlap": 0.0, "step_model": step, "model_config": cfg}))
    hw = HardwareProfile.from_json(path)
    cm = CostModel(ModelShape.from_hf_config(hw.model_config), hw)
    assert cm.step_fixed_s == 0.05 and cm.seconds_per_token == 0.002
    assert cm.seconds_per_row == 0.001 and cm.seconds_per_pair == 5e-7
    assert cm.seconds_per_kv_token == 1e-5 and cm.shape.dtype_bytes == 4
    # one prefill step of 100 tokens (one sampled row) and one decode step reading 500 tokens
    assert cm.step_time(100, 0, rows=1, pairs=5050) == pytest.approx(
        0.05 + 0.2 + 0.001 + 5050 * 5e-7)
    assert cm.step_time(1, 500, rows=1) == pytest.approx(0.05 + 0.002 + 0.001 + 500 * 1e-5)
    assert cm.seconds_per_fresh_kv_token == 0.0  # a profile from before it was measured
    path.write_text(json.dumps({"name": "measured:m@cpu", "flops": 1e11,
                                "bandwidth_bytes_per_s": 4e9, "model_config": cfg,
                                "step_model": {**step, "s_per_fresh_kv_token": 4e-5}}))
    cm = CostModel(ModelShape.from_hf_config(cfg), HardwareProfile.from_json(path))
    # 100 KV tokens written on pages never used cost their first write too
    assert cm.step_compute_time(100, 1, 5050, fresh_kv=100) == pytest.approx(
        0.2 + 0.001 + 5050 * 5e-7 + 100 * 4e-5)
    assert cm.seconds_per_sampled_row == 0.0  # nor a row drawn at random priced apart
    # a profile from before shared reads were priced apart reads them at the plain rate
    assert cm.seconds_per_shared_kv_token == 1e-5
    assert cm.step_memory_time(500, shared=300) == pytest.approx(500 * 1e-5)


def test_rows_drawn_at_random_cost_their_measured_time_on_top():
    step = {"step_fixed_s": 0.05, "s_per_token": 0.002, "s_per_row": 0.001, "s_per_kv_token": 1e-5,
            "s_per_sampled_row": 3e-4}
    data = {"name": "measured:m@cpu", "flops": 1e11, "bandwidth_bytes_per_s": 4e9,
            "step_model": step, "model_config": dict(MODEL_SHAPES["smollm2-135m"])}
    cm = CostModel(ModelShape.from_hf_config(data["model_config"]), HardwareProfile.from_dict(data))
    assert cm.step_compute_time(64, 64, sampled=16) == pytest.approx(64 * 0.003 + 16 * 3e-4)


def test_reads_of_pages_another_decode_reads_cost_the_shared_rate(tmp_path):
    step = {"step_fixed_s": 0.05, "s_per_token": 0.002, "s_per_kv_token": 1e-5,
            "s_per_shared_kv_token": 4e-6}
    data = {"name": "measured:m@cpu", "flops": 1e11, "bandwidth_bytes_per_s": 4e9,
            "step_model": step, "model_config": dict(MODEL_SHAPES["smollm2-135m"])}
    cm = CostModel(ModelShape.from_hf_config(data["model_config"]), HardwareProfile.from_dict(data))
    # four decodes read 500 tokens each; three of them read 400 the first reads too
    assert cm.step_memory_time(2000, shared=1200) == pytest.approx(800 * 1e-5 + 1200 * 4e-6)
    # where the attention cascades the group reads a shared prefix once: the rest costs nothing
    cascade = CostModel(cm.shape, HardwareProfile.from_dict({**data, "cascade": True}))
    assert cascade.step_memory_time(2000, shared=1200) == pytest.approx(800 * 1e-5)


def test_a_profile_file_without_bandwidth_is_rejected(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"name": "measured", "flops": 1e12}))
    with pytest.raises(ProfileError):
        HardwareProfile.from_json(path)


def test_comp_and_mem_follow_the_design_formulas():
    cm = toy_cost()  # P = 1e6 → 2e6 FLOP/token at 1e12 FLOP/s; 1 KiB of KV per token at 1e12 B/s
    pair = 4 * 4 * 64 * 2 / 1e12  # QKᵀ and PV: 4 · heads · head_dim · layers FLOPs
    assert cm.comp(100, 10) == pytest.approx(110 * 2e6 / 1e12 + 100 * 100 / 2 * pair)
    assert cm.comp(100, 10, 60) == pytest.approx(50 * 2e6 / 1e12 + (100**2 - 60**2) / 2 * pair)
    assert cm.mem(100, 10) == pytest.approx((100 * 10 + 10 * 10 / 2) * 1024 / 1e12)
    assert cm.rho(100, 10) == pytest.approx(cm.comp(100, 10) / cm.mem(100, 10))


def test_rho_of_a_request_without_decode_is_infinite():
    assert h200_8b().rho(100, 0) == float("inf")
    assert np.isinf(h200_8b().rho(np.array([100]), np.array([0]))[0])


def test_array_inputs_give_the_same_numbers_as_scalars():
    cm = h200_8b()
    p, d = np.array([10, 500]), np.array([3, 2000])
    assert np.allclose(cm.mem(p, d), [cm.mem(10, 3), cm.mem(500, 2000)])


def test_a_step_reads_the_weights_and_overlaps_compute_with_memory_as_the_device_does():
    cm = toy_cost()
    w = cm.shape.params * 2 / 1e12
    c, kv = cm.step_compute_time(1000), 5000 * 1024 / 1e12
    assert cm.step_fixed_s == pytest.approx(w)
    assert cm.step_memory_time(5000) == pytest.approx(kv + w)  # the weights are memory traffic
    m = kv + w
    for overlap, expect in ((0.0, c + m), (1.0, max(c, m)), (0.8, max(c, m) + 0.2 * min(c, m))):
        model = CostModel(cm.shape, cm.hardware.idealised(overlap=overlap))
        assert model.step_time(1000, 5000) == pytest.approx(expect)
    free = CostModel(cm.shape, cm.hardware.idealised(free_steps=True))
    assert free.step_time(1000, 5000) == pytest.approx(c + kv)


def test_gpu_datasheets_overlap_partly_and_read_the_weights_every_step():
    cm = CostModel.default()
    assert 0.0 < cm.overlap < 1.0
    assert cm.step_fixed_s == pytest.approx(cm.shape.params * 2 / 4.8e12)


def test_the_bound_counts_a_weights_read_for_every_step_no_schedule_can_skip():
    cm = CostModel.default()
    w = cm.step_fixed_s
    assert cm.optimal_makespan(10.0, 4.0, 0.5) == 5.0  # compute-bound: (1 − s)·ΣComp
    assert cm.optimal_makespan(10.0, 6.0, 0.5) == 6.0
    assert cm.optimal_makespan(10.0, 4.0, 0.5, min_steps=1000) == pytest.approx(4.0 + 1000 * w)
    assert min_steps(300, 10_000, 2048) == 300 and min_steps(3, 10_000, 2048) == 10_000 / 2048
