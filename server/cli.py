"""The `blendserve` command: serve, worker, migrate, run, profile, batches.
Each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blendserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the API with one embedded worker process")
    serve.add_argument("--host", default=None, help="default: BLENDSERVE_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: BLENDSERVE_PORT or 8000")
    serve.add_argument("--no-worker", action="store_true", help="API only; run workers apart")

    sub.add_parser("worker", help="run one batch worker (claims batches from SQL or Redis)")
    sub.add_parser("migrate", help="apply database migrations and exit")

    run = sub.add_parser("run", help="run a batch JSONL file offline, like `vllm run-batch`")
    run.add_argument("input", help="input JSONL (OpenAI batch lines)")
    run.add_argument("-o", "--output", required=True, help="output JSONL")
    run.add_argument("--errors", default=None, help="error JSONL (default: beside the output)")
    run.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    run.add_argument("--policy", choices=["fcfs", "dfs", "blend"], default="blend")
    run.add_argument("--max-step-tokens", "--max-batch-tokens", dest="max_batch_tokens", type=int,
                     default=None, help="tokens (decode + prefill) an engine step holds at most "
                                        "(default: BLENDSERVE_MAX_BATCH_TOKENS, else 8192 on "
                                        "a CPU and 2048 on a GPU); every "
                                        "policy takes it")
    run.add_argument("--kv-memory", type=int, default=None, help="KV cache budget in bytes")
    run.add_argument("--device", default=None, help="auto (default) | cpu | cuda")
    run.add_argument("--report", default=None,
                     help="write the plan report here (JSON; a PNG of compute and memory time "
                          "per step goes beside it)")

    prof = sub.add_parser("profile", help="measure the served model's step time on this device")
    prof.add_argument("--model", default=None, help="default: BLENDSERVE_MODEL")
    prof.add_argument("--device", default=None, help="auto (default) | cpu | cuda")
    prof.add_argument("--out", default=None,
                      help="where to write it (default: the cache under DATA_DIR/profiles/, "
                           "which the worker and `run` read)")
    prof.add_argument("--if-missing", action="store_true",
                      help="keep a cached profile that is current (as the worker and `run` load "
                           "it, drift check included); measure only where there is none")

    batches = sub.add_parser("batches", help="list, watch or show batches on a running server")
    batches.add_argument("--base-url", default=None, help="default: OPENAI_BASE_URL, else local")
    batches.add_argument("--api-key", default=None, help="default: OPENAI_API_KEY")
    verbs = batches.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", help="the newest batches with their progress")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--json", action="store_true", help="the raw Batch objects")
    get = verbs.add_parser("get", help="one batch in detail")
    get.add_argument("id")
    get.add_argument("--json", action="store_true", help="the raw Batch object")
    watch = verbs.add_parser("watch", help="progress bars until the batches finish")
    watch.add_argument("ids", nargs="*", help="default: every unfinished batch")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        from server.app import serve_main

        return serve_main(args)
    if args.command == "worker":
        from server.worker import worker_main

        return worker_main(args)
    if args.command == "migrate":
        from server.db import migrate_main

        return migrate_main(args)
    if args.command == "run":
        from server.offline import run_main

        return run_main(args)
    if args.command == "profile":
        from server.offline import profile_main

        return profile_main(args)
    if args.command == "batches":
        from server.batch_client import batches_main

        return batches_main(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
