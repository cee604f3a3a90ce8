"""Structured extraction: a batch that pulls fields out of generated documents as JSON.

Three kinds of seeded, generated documents — staff profiles, product reviews and invoices — each
with its JSON Schema (nested objects, enums, arrays, required fields, a pattern). Every batch
line asks the model to extract one document's fields under its schema (`response_format`
json_schema, strict), so the output file is one JSON object per document that a program can read.

    python bench/structured_extract.py --out bench/out/extract.jsonl [--lines 300]
    blendserve run bench/out/extract.jsonl -o out.jsonl          # or upload it as a batch

`--cost` measures what the constraint costs on this machine: the same lines run once with
`response_format` and once without (max_tokens fixed, ignore_eos off) on one engine; it prints the
wall-time ratio, the per-output-token ratio, the grammar's share of step time (mask building,
applying and matcher advance, from the engine's step log), the share of outputs that validate
against their schema, and how many extracted fields match the document's true values. Each pass
starts from an empty prefix cache; CPU seconds of the process beside wall seconds show how much
of a wall-time difference is other load on the machine. Free text
runs on to max_tokens where the constrained output stops at its closing brace, so the plain
ratio mostly compares output lengths; a third pass, `free_matched`, runs the free lines with
ignore_eos and each line's max_tokens set to its constrained output's length (the same steps
and shapes), and `matched_wall_ratio` is the constraint's own cost.

    python bench/structured_extract.py --cost [--lines 120] [--max-tokens 160] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

SYSTEM = "You extract fields from documents. Reply with one JSON object and nothing else."
_STR = {"type": "string"}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "profile": _obj({
        "name": {**_STR, "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "designer", "manager", "scientist", "teacher"]},
        "location": _obj({"city": {**_STR, "maxLength": 30}, "country": {**_STR, "maxLength": 30}}),
        "skills": {"type": "array", "items": {**_STR, "maxLength": 20}, "minItems": 1,
                   "maxItems": 3},
    }),
    "review": _obj({
        "product": {**_STR, "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "pros": {"type": "array", "items": {**_STR, "maxLength": 30}, "maxItems": 2},
        "would_recommend": {"type": "boolean"},
    }),
    "invoice": _obj({
        "invoice_id": {**_STR, "pattern": "^INV-[0-9]{4}$"},
        "customer": _obj({"name": {**_STR, "maxLength": 40},
                          "tier": {"enum": ["standard", "gold", "platinum"]}}),
        "currency": {"enum": ["USD", "EUR", "GBP"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj({
            "item": {**_STR, "maxLength": 24},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99}})},
        "total_cents": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
    }),
}

_FIRST = ("Maria", "Kenji", "Amara", "Lukas", "Priya", "Omar", "Elena", "Tom", "Sofia", "Ravi")
_LAST = ("Lopez", "Tanaka", "Okafor", "Becker", "Sharma", "Haddad", "Rossi", "Walsh", "Silva")
_PLACES = (("Lisbon", "Portugal"), ("Osaka", "Japan"), ("Lagos", "Nigeria"), ("Berlin", "Germany"),
           ("Pune", "India"), ("Toronto", "Canada"), ("Milan", "Italy"), ("Dublin", "Ireland"))
_SKILLS = ("Python", "SQL", "Go", "Rust", "Figma", "statistics", "budgeting", "hiring", "Excel")
_PRODUCTS = ("TrailRunner 2 shoes", "Aero kettle", "Nimbus desk lamp", "Pico headphones",
             "Orbit coffee grinder", "Vela backpack")
_PROS = ("light", "quiet", "well built", "cheap", "easy to clean", "long battery life")
_ITEMS = ("paper reams", "toner", "desk chairs", "monitors", "cables", "notebooks")


def profile(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    age, role = rng.randint(22, 64), rng.choice(SCHEMAS["profile"]["properties"]["role"]["enum"])
    city, country = rng.choice(_PLACES)
    skills = rng.sample(_SKILLS, rng.randint(1, 3))
    doc = (f"{name} is a {age}-year-old {role} based in {city}, {country}. Colleagues rely on "
           f"{name.split()[0]} for {', '.join(skills)}. Outside work {name.split()[0]} enjoys "
           "hiking and reading.")
    return doc, {"name": name, "age": age, "role": role,
                 "location": {"city": city, "country": country}, "skills": skills}


def review(rng: random.Random) -> tuple[str, dict[str, Any]]:
    product, rating = rng.choice(_PRODUCTS), rng.randint(1, 5)
    sentiment = "positive" if rating >= 4 else "neutral" if rating == 3 else "negative"
    pros = rng.sample(_PROS, rng.randint(0, 2))
    liked = f"I liked that it is {' and '.join(pros)}." if pros else "Nothing stood out."
    doc = (f"Review of the {product}: {rating} out of 5 stars. {liked} "
           f"{'I would recommend it.' if rating >= 4 else 'I would not buy it again.'}")
    return doc, {"product": product, "rating": rating, "sentiment": sentiment, "pros": pros,
                 "would_recommend": rating >= 4}


def invoice(rng: random.Random) -> tuple[str, dict[str, Any]]:
    inv, cur = f"INV-{rng.randint(0, 9999):04d}", rng.choice(("USD", "EUR", "GBP"))
    customer = {"name": f"{rng.choice(_LAST)} Ltd", "tier": rng.choice(("standard", "gold",
                                                                         "platinum"))}
    lines = [{"item": it, "quantity": rng.randint(1, 20)}
             for it in rng.sample(_ITEMS, rng.randint(1, 2))]
    total = sum(line["quantity"] * rng.randint(200, 5000) for line in lines)
    listed = "; ".join(f"{line['quantity']} x {line['item']}" for line in lines)
    doc = (f"Invoice {inv} for {customer['name']} ({customer['tier']} customer). Items: {listed}. "
           f"Total due: {total / 100:.2f} {cur} ({total} cents).")
    return doc, {"invoice_id": inv, "customer": customer, "currency": cur, "lines": lines,
                 "total_cents": total}


KINDS = {"profile": profile, "review": review, "invoice": invoice}


def make_lines(n: int, *, seed: int = 0, max_tokens: int = 160,
               structured: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """n batch lines (kinds in turn) and {custom_id: (kind, true fields)}."""
    rng = random.Random(seed)
    lines, truth = [], {}
    for i in range(n):
        kind = list(KINDS)[i % len(KINDS)]
        doc, fields = KINDS[kind](rng)
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Extract the {kind} fields of this document "
                                                     f"as JSON.\n\n{doc}"}],
            "max_tokens": max_tokens, "temperature": 0,
        }
        if structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": kind, "schema": SCHEMAS[kind], "strict": True}}
        cid = f"{kind}-{i}"
        lines.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                      "body": body})
        truth[cid] = (kind, fields)
    return lines, truth


def field_matches(kind: str, got: Any, want: dict[str, Any]) -> tuple[int, int]:
    """(top-level fields equal to the truth, fields) of one output."""
    if not isinstance(got, dict):
        return 0, len(SCHEMAS[kind]["properties"])
    return sum(got.get(k) == v for k, v in want.items()), len(want)


def _run(lines: list[dict[str, Any]], engine: Any) -> tuple[float, float, list[Any], float]:
    """(wall seconds, CPU seconds of this process, results, grammar share of step time) of one
    pass through the pipeline, from an empty prefix cache (passes share prompts)."""
    from server.batch_input import BatchLine
    from server.pipeline import run_lines

    engine.cache.evict(engine.cache.evictable_pages)
    items = [BatchLine(i + 1, ln["custom_id"], ln["body"]) for i, ln in enumerate(lines)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = list(run_lines(items, engine, endpoint="/v1/chat/completions", policy="fcfs"))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    log = engine.step_log
    share = sum(r.grammar_seconds for r in log) / max(sum(r.seconds for r in log), 1e-9)
    return wall, cpu, results, share


def cost(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema
    import torch

    from runtime.engine import Engine, EngineConfig
    from runtime.loader import DEFAULT_MODEL, load_model

    torch.set_num_threads(args.threads)
    engine = Engine(load_model(DEFAULT_MODEL, data_dir=Path(args.data_dir)),
                    EngineConfig(max_batch_tokens=2048))
    free, truth = make_lines(args.lines, seed=args.seed, max_tokens=args.max_tokens,
                             structured=False)
    constrained, _ = make_lines(args.lines, seed=args.seed, max_tokens=args.max_tokens)
    _run(constrained[:3], engine)  # warm-up: xgrammar import, compiles, first-step allocations
    out: dict[str, Any] = {"lines": args.lines, "max_tokens": args.max_tokens,
                           "threads": args.threads}
    lengths: dict[str, int] = {}
    for name in ("constrained", "free", "free_matched"):
        lines = {"constrained": constrained, "free": free}.get(name) or [
            {**ln, "body": {**ln["body"], "ignore_eos": True,
                            "max_tokens": max(lengths[ln["custom_id"]], 1)}} for ln in free]
        wall, cpu, results, share = _run(lines, engine)
        if name == "constrained":
            lengths = {r.custom_id: r.output_tokens for r in results}
        tokens = sum(r.output_tokens for r in results)
        valid = fields = total = 0
        for r in results:
            kind, want = truth[r.custom_id]
            try:
                got = json.loads(r.record["response"]["body"]["choices"][0]["message"]["content"])
                jsonschema.validate(got, SCHEMAS[kind])
                valid += 1
            except (KeyError, TypeError, ValueError, jsonschema.ValidationError):
                got = None
            hit, n = field_matches(kind, got, want)
            fields, total = fields + hit, total + n
        out[name] = {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "output_tokens": tokens,
                     "ms_per_output_token": round(1e3 * wall / max(tokens, 1), 2),
                     "grammar_share_of_step_time": round(share, 4),
                     "valid_json_for_schema": f"{valid}/{len(results)}",
                     "fields_correct": f"{fields}/{total}"}
    f, c, m = out["free"], out["constrained"], out["free_matched"]
    out["wall_ratio"] = round(c["wall_s"] / f["wall_s"], 3)
    out["per_token_ratio"] = round(c["ms_per_output_token"] / f["ms_per_output_token"], 3)
    out["matched_wall_ratio"] = round(c["wall_s"] / m["wall_s"], 3)
    out["matched_cpu_ratio"] = round(c["cpu_s"] / m["cpu_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the batch JSONL here")
    ap.add_argument("--lines", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost", action="store_true", help="measure the constraint's cost")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default="data")
    args = ap.parse_args(argv)
    if args.out:
        lines, _ = make_lines(args.lines, seed=args.seed, max_tokens=args.max_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"wrote {len(lines)} lines to {args.out}")
    if args.cost:
        print(json.dumps(cost(args), indent=2))
    if not args.out and not args.cost:
        ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
