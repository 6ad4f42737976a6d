"""Measure real one-GPU training steps (``ndplan measure --backend cuda``) and, beside each, the
same step on fake tensors (``--backend fake``), for the cases in ``CASES``.

Each measurement runs in a fresh Python process: a process that used the GPU before keeps cuBLAS
workspaces and cached segments that would count in the next one's peak. The fake measurements
run on the CPU alongside (``--jobs`` at a time). Everything lands in one JSON file per backend in
``--out`` (rewritten after each case, so a run cut short keeps what it finished):
``cuda_steps.json`` and ``fake_steps.json``, lists of measured-memory documents (the schema
``ndplan verify --measured`` reads), and ``log.txt``.

    python benchmarks/accuracy/cuda_steps.py --out /tmp/steps            # on a machine with a GPU
    python benchmarks/accuracy/cuda_steps.py --split /tmp/steps tests/data/measured/cuda
    python benchmarks/accuracy/cuda_steps.py --report tests/data/measured/cuda docs/accuracy_cuda.md

``--split`` writes each document of both lists to its own file, named after its case; ``--report``
compares every real step with the estimate and writes the page.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: name -> (model, decoder layers, extra `ndplan measure` flags), most telling first: a run cut short
#: by its time limit keeps the first ones. A name ending in ``-expandable`` runs with the caching
#: allocator's expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as
#: torchtitan's launcher sets it).
EXPANDABLE = "-expandable"
CASES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "llama8b-s4k": ("llama-3.1-8b", 2, ("--seq", "4096")),
    "qwen3-moe-s4k-mbs2": ("qwen3-30b-a3b", 2, ("--seq", "4096", "--mbs", "2")),
    "dsv2-lite-s4k": ("deepseek-v2-lite", 2, ("--seq", "4096")),
    "mistral-s8k": ("mistral-7b", 2, ("--seq", "8192")),
    "llama8b-s4k-mbs2-sel": ("llama-3.1-8b", 2, ("--seq", "4096", "--mbs", "2", "--recompute", "selective")),
    "llama8b-s8k-full": ("llama-3.1-8b", 2, ("--seq", "8192", "--recompute", "full")),
    "llama8b-s4k-m4": ("llama-3.1-8b", 2, ("--seq", "4096", "--num-micro-batches", "4")),
    "llama8b-s4k-fp32": ("llama-3.1-8b", 2, ("--seq", "4096", "--precision", "fp32")),
    "mixtral-s4k": ("mixtral-8x7b", 2, ("--seq", "4096")),
    "qwen25-7b-s4k": ("qwen2.5-7b", 2, ("--seq", "4096")),
    "qwen3-8b-s8k-sel": ("qwen3-8b", 2, ("--seq", "8192", "--recompute", "selective")),
    "llama8b-s16k-full": ("llama-3.1-8b", 2, ("--seq", "16384", "--recompute", "full")),
    "mistral-s16k": ("mistral-7b", 2, ("--seq", "16384")),
    "gpt-oss-20b-s2k-eager": ("gpt-oss-20b", 2, ("--seq", "2048", "--attention", "eager")),
    "qwen3-moe-s8k-full": ("qwen3-30b-a3b", 2, ("--seq", "8192", "--recompute", "full")),
    # whole models (or as deep as one H200 holds): the allocator's reserved segments at depth
    "mistral-s8k-sel": ("mistral-7b", 2, ("--seq", "8192", "--recompute", "selective")),
    "llama8b-32l-s4k-full": ("llama-3.1-8b", 32, ("--seq", "4096", "--recompute", "full")),
    "llama8b-32l-s4k-sel": ("llama-3.1-8b", 32, ("--seq", "4096", "--recompute", "selective")),
    "mistral-32l-s8k-sel": ("mistral-7b", 32, ("--seq", "8192", "--recompute", "selective")),
    "qwen3-8b-36l-s4k-full": ("qwen3-8b", 36, ("--seq", "4096", "--recompute", "full")),
    "qwen3-moe-12l-s4k-full": ("qwen3-30b-a3b", 12, ("--seq", "4096", "--recompute", "full")),
    "dsv2-lite-12l-s4k-full": ("deepseek-v2-lite", 12, ("--seq", "4096", "--recompute", "full")),
    "llama8b-32l-s4k": ("llama-3.1-8b", 32, ("--seq", "4096")),
    "llama8b-32l-s4k-sel-expandable": ("llama-3.1-8b", 32, ("--seq", "4096", "--recompute", "selective")),
    "llama8b-s16k-full-expandable": ("llama-3.1-8b", 2, ("--seq", "16384", "--recompute", "full")),
    "qwen3-moe-s4k-mbs2-expandable": ("qwen3-30b-a3b", 2, ("--seq", "4096", "--mbs", "2")),
    # eager attention: the s x s softmax and its backward on CUDA
    "llama8b-s4k-eager": ("llama-3.1-8b", 2, ("--seq", "4096", "--attention", "eager")),
    "llama8b-s8k-eager-full": ("llama-3.1-8b", 2, ("--seq", "8192", "--attention", "eager", "--recompute", "full")),
}

_MAIN = "import sys; from ndplan.cli import main; sys.exit(main())"


def _measure(name: str, backend: str, out: Path) -> tuple[str, dict | None, str]:
    model, layers, flags = CASES[name]
    path = out / f".{backend}-{name}.json"
    cmd = [sys.executable, "-c", _MAIN, "measure", model, "--layers", str(layers), *flags,
           "--backend", backend, "--out", str(path), "--json"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")) if backend == "cuda" \
        else dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if name.endswith(EXPANDABLE):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0 or not path.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return name, None, f"{backend} {name}: FAILED in {elapsed:.0f} s: {' | '.join(tail)}"
    doc = json.loads(path.read_text())
    doc["case"] = name
    path.unlink()
    peak = doc["ranks"][0]["allocated_bytes"] / 2**30
    return name, doc, f"{backend} {name}: {peak:.3f} GiB allocated, {elapsed:.0f} s"


def run(out: Path, jobs: int, only: list[str], backends: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = only or list(CASES)
    results: dict[str, list[dict]] = {"cuda": [], "fake": []}
    log = out / "log.txt"

    def record(backend: str, item: tuple[str, dict | None, str]) -> None:
        _, doc, line = item
        print(line, flush=True)
        with log.open("a") as f:
            f.write(line + "\n")
        if doc is not None:
            results[backend].append(doc)
            (out / f"{backend}_steps.json").write_text(json.dumps(results[backend], indent=1))

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        fakes = [pool.submit(_measure, name, "fake", out) for name in names] if "fake" in backends else []
        if "cuda" in backends:
            for name in names:  # one GPU: the real steps run one after another
                record("cuda", _measure(name, "cuda", out))
        for future in fakes:
            record("fake", future.result())


def split(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for backend in ("cuda", "fake"):
        path = src / f"{backend}_steps.json"
        if not path.exists():
            continue
        for doc in json.loads(path.read_text()):
            target = dest / f"{doc.pop('case')}-{backend}.json"
            target.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {target}")


def report(data: Path, target: Path) -> None:
    """docs/accuracy_cuda.md: every real step in ``data`` against the estimate (``ndplan verify``)."""
    from ndplan.census.measurement import load_measurement
    from ndplan.census.verify import verify
    from ndplan.model import load_model

    gib = 2**30
    rows = []
    # (layers, recompute, eager attention, errors by row key, reserved / allocated) per case:
    # the commentary's figures come from these, so that they cannot go stale.
    facts: dict[str, tuple[int, str, bool, dict[str, float], float]] = {}
    for path in sorted(data.glob("*-cuda.json")):
        measurement = load_measurement(path)
        result = verify(load_model(measurement.model), measurement).stages[0]
        s = measurement.strategy
        cells = {key: result.row(key) for key in ("activations", "forward_backward_peak", "allocated", "reserved")}
        allocated, reserved = cells["allocated"], cells["reserved"]
        assert allocated is not None and reserved is not None and allocated.measured and reserved.measured
        setup = (f"{measurement.num_layers} layers, seq {s.seq_length}, mbs {s.micro_batch_size}, "
                 f"m {s.num_micro_batches}, {s.recompute}, {s.precision.name}"
                 + (", eager" if measurement.attention == "eager" else "")
                 + (", expandable segments" if measurement.provenance.get("allocator_conf") else ""))
        case = path.name.removesuffix("-cuda.json")
        # The same step on fake tensors, its allocations replayed through the caching allocator
        # (ndplan.census.allocator), against the measured reserved peak.
        fake_path = data / f"{case}-fake.json"
        replayed = load_measurement(fake_path).ranks[0].replayed_reserved_bytes if fake_path.exists() else None
        replay_error = None if replayed is None else (replayed / reserved.measured - 1) * 100
        rows.append(f"| {case} | {measurement.model} | {setup} | "
                    f"{allocated.measured / gib:.3f} | {allocated.estimate / gib:.3f} | "
                    + " | ".join(f"{row.error_pct:+.2f}%" if row is not None and row.error_pct is not None else "-"
                                 for row in cells.values())
                    + f" | {reserved.measured / allocated.measured:.3f} | "
                    + ("-" if replay_error is None else f"{replay_error:+.2f}%") + " |")
        errors = {key: row.error_pct for key, row in cells.items() if row is not None and row.error_pct is not None}
        if replay_error is not None:
            errors["replayed"] = replay_error
        facts[case] = (measurement.num_layers or 0, s.recompute, measurement.attention == "eager", errors,
                       reserved.measured / allocated.measured)
    whole = {k: f for k, f in facts.items() if f[0] >= 12}
    short = {k: f for k, f in facts.items() if f[0] < 12}

    def span(values: list[float], fmt: str = "{:+.1f}%") -> str:
        low, high = min(values), max(values)
        return fmt.format(low) if f"{low:.3f}" == f"{high:.3f}" else f"{fmt.format(low)} to {fmt.format(high)}"

    full_fwd_bwd = span([f[3]["forward_backward_peak"] for f in whole.values() if f[1] == "full"])
    gpt_oss = next(f[3] for k, f in facts.items() if k.startswith("gpt-oss") and f[2])
    whole_ratio = span([f[4] for f in whole.values()], "{:.3f}")
    short_ratio = span([f[4] for f in short.values()], "{:.3f}")
    short_reserved = span([f[3]["reserved"] for f in short.values()])
    all_reserved = span([f[3]["reserved"] for f in facts.values()])
    replays = [f[3]["replayed"] for f in facts.values() if "replayed" in f[3]]
    replayed_span = span(replays)
    replayed_within_1 = sum(abs(e) <= 1.0 for e in replays)
    first = load_measurement(sorted(data.glob("*-cuda.json"))[0]).provenance
    text = f"""# Memory accuracy on a real GPU

<!-- Generated by `.venv/bin/python benchmarks/accuracy/cuda_steps.py --report tests/data/measured/cuda docs/accuracy_cuda.md`. -->

Each row is one real training step (forward, backward, AdamW) of a depth-trimmed or whole
Hugging Face model on one {first.get("device")}, torch {first.get("torch_version")},
transformers {first.get("transformers_version")}, measured by `ndplan measure --backend cuda`
(`torch.cuda.max_memory_allocated` and `max_memory_reserved` of the second step after an
optimizer warm-up, each case in a fresh process), and compared by `ndplan verify --measured`
with the estimate of the same step (the `pytorch` runtime, SDPA attention, the cuBLAS
workspace counted). Error is (estimate − measured) / measured. The files are
tests/data/measured/cuda; tests/test_measured_cuda.py holds the estimator to them. To measure
again on a machine with a GPU: `python benchmarks/accuracy/cuda_steps.py --out DIR` (each case
in a fresh process, the fake step of the same case beside it), then
`python benchmarks/accuracy/cuda_steps.py --split DIR tests/data/measured/cuda`.

The last column replays the same step on fake tensors (`ndplan measure`, `*-fake.json`) through
PyTorch's caching allocator (`ndplan.census.allocator`) and compares the reserved peak it
reaches with the measured one.

| case | model | step | measured GiB | estimate GiB | activations | fwd/bwd peak | peak allocated | peak reserved | reserved / allocated | reserved, replayed |
| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

What the rows say:

* Peak allocated is within 1% in every case. Where the attention materialises its s × s
  scores (fp32 with grouped KV heads, where SDPA runs its math path; eager attention), the
  peak is a layer's attention backward: the probabilities' gradient, softmax's gradient and,
  on CUDA, a temporary product of the same size that softmax's backward allocates beside its
  output (found with the allocator's record, `benchmarks/accuracy/cuda_probe.py history`).
  Before that working set was priced, fp32 GQA read −5.0% and eager attention under full
  recompute at 8k −37.9%.
* The same steps on fake tensors (`*-fake.json`) allocate exactly what the real ones do but
  64 MiB: cuBLAS's and cuBLASLt's workspaces, which the `pytorch` profile now counts
  (`overhead.workspace_bytes`) wherever overhead is included; and, where the scores are
  materialised and their backward sets the peak, CUDA softmax's temporary product, which a
  fake kernel does not allocate (8 GiB for eager attention at 8k). Both count as overhead, so
  `verify` leaves them out of a fake step's estimate: every fake step reads within 1% too.
* A sliding window at seq ≥ window (Mistral at 8k and 16k) costs each layer an s × s additive
  bias and K/V repeated to every head under transformers' SDPA: 224 MiB per layer at 8k, 704 MiB
  at 16k, now priced (before: −4.1% and −7.8%). Under recompute they are rebuilt, but each
  chunk's checkpoints keep the boolean mask once per micro-batch (64 MiB at 8k), priced too
  (mistral-s8k-sel read −0.76% before).
* gpt-oss-20b under eager attention (transformers' only path for its sinks): activations
  {gpt_oss["activations"]:+.2f}% (+45% until the forty-seventh session, which priced its softmax in bf16 over one more
  column with the row maxima's indices, its clamped SwiGLU's three more tensors a routed copy and
  its norms' fp32 products, each from a tiny model's census), forward/backward peak
  {gpt_oss["forward_backward_peak"]:+.1f}% (its backward's working set; its peak is the optimizer step's,
  {gpt_oss["allocated"]:+.2f}%). Over-estimates, on the safe side: whole models under full recompute read
  {full_fwd_bwd} at the forward/backward peak (their peak too is the optimizer step's).
* Reserved over allocated is {whole_ratio} for whole models (12–36 layers), where the profile's
  5% slack is within ±5%; short two-layer models reach {short_ratio} (their transient logits and
  s × s blocks fragment the cache), where the estimate of reserved reads {short_reserved}.
  Expandable segments (`PYTORCH_CUDA_ALLOC_CONF`) lower it at depth (1.019 → 1.007 for
  Llama-3.1-8B with selective recompute) and hardly at all on short models.
* Replaying the allocator (last column) over the fake step's {len(replays)} allocation sequences
  lands {replayed_span} from the measured reserved peak ({replayed_within_1} within 1%), where the
  estimate's fixed slack reads {all_reserved}: fragmentation is not a constant fraction but what
  the allocator's rules make of the order and sizes of a step's blocks. The replay
  follows c10's native allocator with its default settings (`ndplan.census.allocator`; these
  steps run on one stream); the expandable-segments rows are replayed as native ones and
  still land near. `ndplan measure` prints it and `ndplan verify` shows it beside the
  estimate's reserved figure.
"""
    target.write_text(text)
    print(f"wrote {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for cuda_steps.json, fake_steps.json and log.txt")
    parser.add_argument("--jobs", type=int, default=4, help="fake measurements at a time (default 4)")
    parser.add_argument("--only", nargs="*", default=[], choices=sorted(CASES), metavar="CASE")
    parser.add_argument("--backends", nargs="+", default=["cuda", "fake"], choices=["cuda", "fake"])
    parser.add_argument("--split", nargs=2, type=Path, metavar=("SRC", "DEST"),
                        help="write each measurement in SRC's lists to its own file in DEST")
    parser.add_argument("--report", nargs=2, type=Path, metavar=("DATA", "PAGE"),
                        help="write the Markdown page comparing DATA's real steps with the estimate")
    args = parser.parse_args()
    if args.report:
        report(*args.report)
    elif args.split:
        split(*args.split)
    elif args.out:
        run(args.out, args.jobs, args.only, args.backends)
    else:
        parser.error("give --out FOLDER (measure) or --split SRC DEST")


if __name__ == "__main__":
    main()
