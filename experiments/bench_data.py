"""Token cache build speed: the suite's pipeline vs bare Hugging Face ``encode_batch``, for 1..N processes.

    python -m experiments.bench_data --tokenizer /data/gpt2_tokenizer --data text \\
        --data.path /data/openwebtext_sample.txt --procs 1,2 --repeats 3 --copies 40

For each process count P and each repetition, in one run: ``ours`` builds the cache
(``datamodules/cache_build.py``, P encoder processes, into a temporary folder; ``ours-hf`` the same with the
tiktoken path switched off), and ``hf`` encodes the same documents with ``Tokenizer.encode_batch`` (batches
of 1000) in a fresh process whose Rayon pool has P threads (``TOKENIZERS_PARALLELISM`` on for P > 1).
Reported: the median over the repetitions of tokens per wall second, tokens per CPU-second of everything
(ours: this process + its workers, from ``getrusage``, worker start-up included; hf: the process's CPU time)
and, for ours, of the encoders alone (the workers' ``time.process_time`` around each shard) and of the main
process alone (it reads the documents, feeds the workers and writes the file: with P > 1 its rate bounds the
build's, whatever the number of cores). On a shared
machine only the per-CPU-second figures mean anything; the wall figures need an idle one.
The documents are the corpus's (``--split_blank_lines``: its paragraphs), repeated ``--copies`` times (the
BPE caches of both libraries see the repeats); tokens are the text's, without the build's EOT separators.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from datamodules.catalog import get_corpus
from datamodules.files import default_cache_dir
from datamodules.tokenizer import TextTokenizer, ensure_tokenizer

HF_BATCH = 1000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="text", help="data.name (text, embedded, openwebtext, ...)")
    parser.add_argument("--data.path", dest="path", nargs="*", default=[], help="files for --data text / hub corpora")
    parser.add_argument("--tokenizer", default=None, help="gpt2, bpe, bytes or a folder (default: the corpus's)")
    parser.add_argument("--procs", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=1, help="repeat the corpus's documents this many times")
    parser.add_argument("--split_blank_lines", action="store_true",
                        help="cut each document at blank lines (a text sample that marks no document boundaries)")
    parser.add_argument("--paths", default="ours,hf", help="which of ours, ours-hf, hf to measure")
    parser.add_argument("--hf_baseline", type=int, default=0, help=argparse.SUPPRESS)  # internal: one hf measurement
    return parser.parse_args(argv)


def load(args) -> tuple:
    cache = default_cache_dir()
    corpus = get_corpus(args.data, path=args.path, cache_dir=cache)
    tokenizer = ensure_tokenizer(args.tokenizer, corpus, cache)
    docs = list(corpus.documents())
    if args.split_blank_lines:
        docs = [part for doc in docs for part in re.split(r"\n\s*\n", doc) if part.strip()]
    return docs * args.copies, tokenizer


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the build's workers), user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_ours(docs: List[str], tokenizer: TextTokenizer, procs: int, tiktoken: bool) -> Dict[str, float]:
    from datamodules.cache_build import build_cache

    with tempfile.TemporaryDirectory(prefix="bench_data") as tmp:
        cpu, own, wall = cpu_seconds(), time.process_time(), time.perf_counter()
        stats = build_cache(docs, tokenizer, pathlib.Path(tmp) / "c", "bench", num_proc=procs,
                            prefer_tiktoken=tiktoken)
        wall, cpu, own = time.perf_counter() - wall, cpu_seconds() - cpu, time.process_time() - own
    # the text's tokens, as encode_batch counts them (the build adds one EOT per document)
    return {"tokens": stats.num_tokens - stats.num_documents, "wall_s": wall, "cpu_s": cpu, "encode_cpu_s": stats.cpu_s,
            "main_cpu_s": own}


def measure_hf_here(docs: List[str], tokenizer: TextTokenizer) -> Dict[str, float]:
    hf = tokenizer.tokenizer
    cpu, wall, tokens = time.process_time(), time.perf_counter(), 0
    for start in range(0, len(docs), HF_BATCH):
        tokens += sum(len(e.ids) for e in hf.encode_batch(docs[start:start + HF_BATCH], add_special_tokens=False))
    return {"tokens": tokens, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}


def measure_hf(argv: List[str], procs: int) -> Dict[str, float]:
    """Bare ``encode_batch`` in a fresh process: Rayon's thread count is fixed when its pool first starts."""
    env = {**os.environ, "RAYON_NUM_THREADS": str(procs), "TOKENIZERS_PARALLELISM": "true" if procs > 1 else "false"}
    out = subprocess.run([sys.executable, "-m", "experiments.bench_data", *argv, "--hf_baseline", str(procs)],
                         env=env, check=True, capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).resolve().parents[1]).stdout  # this checkout's code
    return json.loads(out.strip().splitlines()[-1])


def summarise(runs: List[Dict[str, float]]) -> Dict[str, float]:
    med = lambda key: statistics.median(r["tokens"] / r[key] for r in runs)  # noqa: E731
    out = {"tokens": runs[0]["tokens"], "tok_per_s": med("wall_s"), "tok_per_cpu_s": med("cpu_s")}
    if "encode_cpu_s" in runs[0]:
        out["tok_per_encode_cpu_s"] = med("encode_cpu_s")
        out["tok_per_main_cpu_s"] = med("main_cpu_s")
    return out


def table(rows: List[tuple]) -> str:
    lines = ["| processes | path | tokens | tokens/s (wall) | tokens per CPU-s (all) | per CPU-s (encoders) "
             "| per CPU-s (main process) |", "|---|---|---|---|---|---|---|"]
    for procs, path, s in rows:
        enc, main = (f"{s[k]:,.0f}" if k in s else "" for k in ("tok_per_encode_cpu_s", "tok_per_main_cpu_s"))
        lines.append(f"| {procs} | {path} | {s['tokens']:,} | {s['tok_per_s']:,.0f} | {s['tok_per_cpu_s']:,.0f} | {enc} "
                     f"| {main} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    docs, tokenizer = load(args)
    if args.hf_baseline:
        print(json.dumps(measure_hf_here(docs, tokenizer)))
        return ""
    paths = args.paths.split(",")
    rows = []
    for procs in [int(p) for p in args.procs.split(",")]:
        runs: Dict[str, list] = {p: [] for p in paths}
        for _ in range(args.repeats):  # interleaved: a load change hits every path alike
            for path in paths:
                runs[path].append(measure_hf(argv, procs) if path == "hf" else
                                  measure_ours(docs, tokenizer, procs, tiktoken=path == "ours"))
        rows += [(procs, path, summarise(runs[path])) for path in paths]
    text = table(rows)
    print(f"{len(docs):,} documents, tokenizer {tokenizer.name}, median of {args.repeats}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n{text}")
    return text


if __name__ == "__main__":
    main()
