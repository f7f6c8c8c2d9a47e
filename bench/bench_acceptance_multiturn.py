"""Multi-turn acceptance: drafts trained on multi-turn data made four ways, scored on multi-turn held-out
chats served as the target serves them (every earlier answer its own).

    make install trainers
    flock /tmp/heavy.lock nice -n 5 .venv/bin/python bench/bench_acceptance_multiturn.py [--seeds 0 1 2] [--served]

bench/bench_acceptance.py's machinery (its runs, exports, speculators EAGLE-3 training and τ counting, table and
plot), on multi-turn chats composed from the tiny corpus (2-4 question/answer turns; a fifth of the questions held
out for the evaluation chats). Four training sets from the SAME chats, same steps, seeds and draft:
  (i)   conversation — `generate.regenerate: conversation`: every turn regenerated on the model's own earlier answers
  (ii)  every_turn   — `every_assistant_turn`: every turn regenerated on the data's own history
  (iii) last_turn    — `last_turn`: the last turn only (one row per chat)
  (iv)  original     — `none`: the data's own last answer (one row per chat; `none` keeps the last turn only)
Scored on held-out chats regenerated with `conversation` (greedy: temperature 0; sampled: the target's sampling),
each turn a sample whose prompt holds the target's own earlier answers: what a served drafter sees. Exports use
speculators' default `--loss-turns last_turn` (each turn's own row, the loss on that turn).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_acceptance as ba  # noqa: E402

# bench_acceptance trains its "regenerated" set's export as the untrained floor too: (i) takes that key.
ba.SETS = {"regenerated": "(i) conversation: every turn on the model's own answers",
           "every_turn": "(ii) every_assistant_turn: every turn on the data's history",
           "last_turn": "(iii) last turn only",
           "original": "(iv) the data's own answers (last turn)",
           "untrained": "untrained draft (the floor)"}


def write_chats(out: str, num_train: int, num_eval: int, seed: int) -> tuple[str, str, dict]:
    """Training chats (system?, 2-4 question/answer turns of the data) and held-out chats on questions no training
    chat asks (their answers are the data's, replaced turn by turn when they are regenerated)."""
    pairs = ba.demo_pairs()
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    held = set(order[: len(pairs) // 5])
    train_pairs = [pairs[i] for i in range(len(pairs)) if i not in held]
    eval_pairs = [pairs[i] for i in sorted(held)]

    def chat(name: str, i: int, source: list) -> dict:
        messages = [{"role": "system", "content": ba.SYSTEM}] if rng.random() < 0.3 else []
        for q, a in rng.sample(source, 2 + i % 3):
            messages += [{"role": "user", "content": rng.choice(ba.STYLES).format(q=q)},
                         {"role": "assistant", "content": a}]
        return {"id": f"{name}-{i:05d}", "prompt": None, "messages": messages, "source": "bench"}

    paths = []
    for name, rows in (("train", [chat("train", i, train_pairs) for i in range(num_train)]),
                       ("eval", [chat("eval", i, eval_pairs) for i in range(num_eval)])):
        path = os.path.join(out, "prompts", name)
        os.makedirs(path, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows, schema=ba.DEMO_SCHEMA), os.path.join(path, "prompts-00000.parquet"))
        paths.append(path)
    return paths[0], paths[1], {"questions": len(pairs), "held_out_questions": len(held), "train_chats": num_train,
                                "eval_chats": num_eval}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-acceptance-multiturn")
    parser.add_argument("--train-chats", type=int, default=192)
    parser.add_argument("--eval-chats", type=int, default=48)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256, help="per turn; a chat's later prompts hold its "
                        "earlier answers, within the demo config's max_model_len 1024")
    parser.add_argument("--model", choices=sorted(ba.MODELS), default="dense")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--reuse-drafts", action="store_true", help="reuse OUT/scores-seed<N>.json and its drafts "
                        "where an earlier run of the same steps, lr and k left them (no retraining)")
    parser.add_argument("--served", action="store_true", help="also serve the first seed's drafts in vLLM "
                        "(bench/served_acceptance.py: τ from the engine's own counters; 6 engines) on the greedy "
                        "held-out turns, each prompt holding the target's own earlier answers")
    args = parser.parse_args()
    if not os.path.exists(ba.TRAINERS_PY):
        parser.error("the trainers' environment is missing: run `make trainers` first")
    started = time.monotonic()
    if args.fresh:
        shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    model = ba.ensure_tiny_model(ba.MODELS[args.model], architecture=args.model)
    train_in, eval_in, chats = write_chats(args.out, args.train_chats, args.eval_chats, args.data_seed)
    sampling = {"generate.sampling": {"max_tokens": args.max_tokens}}

    def run(name: str, inp: str, mode: str, **extra) -> dict:
        return ba.make_run(name, model, inp, args.out, args.data_seed,
                           **{**sampling, "generate.regenerate": mode, **extra})

    runs = {"regenerated": run("conversation", train_in, "conversation"),
            "every_turn": run("every_turn", train_in, "every_assistant_turn"),
            "last_turn": run("last_turn", train_in, "last_turn"),
            "original": run("original", train_in, "none"),
            "eval_greedy": run("eval_greedy", eval_in, "conversation",
                               **{"generate.sampling": {"max_tokens": args.max_tokens, "temperature": 0.0}}),
            "eval_sampled": run("eval_sampled", eval_in, "conversation")}
    data_seconds = time.monotonic() - started
    for name, r in runs.items():
        r.update(ba.completion_stats(r["run"]))
        print(f"{name}: {json.dumps(r)}", flush=True)
    exports = {name: ba.export(runs[name]["run"], os.path.join(args.out, "exports", name))
               for name in ("regenerated", "every_turn", "last_turn", "original")}
    eval_greedy = ba.export(runs["eval_greedy"]["run"], os.path.join(args.out, "exports", "eval_greedy"))
    eval_sampled = ba.export(runs["eval_sampled"]["run"], os.path.join(args.out, "exports", "eval_sampled"))
    all_scores = []
    for seed in args.seeds:
        scores = ba.train_and_score(exports, eval_greedy, eval_sampled, args.out, seed, args.steps, args.lr, args.k,
                                    args.reuse_drafts)
        ba.check_known_answer(scores)
        all_scores.append(scores)
    summary = ba.summarize(all_scores)
    table = ba.markdown(summary, args.k, args.seeds)
    served = (ba.serve(args.out, model, args.seeds[0], args.k, reuse=args.reuse_drafts, max_tokens=args.max_tokens)
              if args.served else None)
    if served:
        table += (f"\n\nServed ({served['engine']}; drafts of training seed {args.seeds[0]}):\n\n"
                  + ba.served_markdown(served, all_scores[0]))
    seconds = round(time.monotonic() - started)
    results = {"command": "bench/bench_acceptance_multiturn.py " + " ".join(sys.argv[1:]), "model": args.model,
               "chats": chats, "runs": runs, "summary": summary, "seeds": args.seeds, "steps": args.steps,
               "lr": args.lr, "k": args.k, "data_seconds": round(data_seconds), "seconds": seconds,
               "served": served, "scores": all_scores}
    with open(os.path.join(args.out, "acceptance.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "acceptance.md"), "w") as f:
        f.write(table + "\n")
    ba.plot(summary, args.k, os.path.join(args.out, "acceptance.png"), args.model, len(args.seeds), served)
    print(table)
    print(f"done in {seconds} s (data {data_seconds:.0f} s); {args.out}/acceptance.json, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
