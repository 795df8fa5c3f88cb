"""GRPO with LoRA on the hybrid rewards, and the before/after evaluation, on a CUDA machine without network access.

What the GPU machine does is ``run``, in one call or several; what it needs comes over in pieces a file transfer can
carry (see docs/rl.md, "On a CUDA machine without network access"):

- ``pack`` (on a machine with network access, in the repository root): the Python wheels a plain CUDA/PyTorch image
  lacks (TRL and what it needs, cp312 manylinux, versions as installed here) into ``.whl/``; the embedded GGUF
  (Qwen2.5-Coder-0.5B, named explicitly: it is the model these runs train) gzip-compressed in pieces, one folder each
  under ``.gguf-parts/`` with a manifest of SHA-256 sums, sized so that each transfer carries what 64 MiB hold beside
  the repository's own files, which travel every time (or ``--carry-mb`` MB); and the GGUF's tokenizer converted here
  (``tokenizer.tgz``: converting it there was nearly all of the 82 s the base checkpoint took on 2026-11-27), which
  travels in piece 00's folder with the wheels. Both folders are ignored by git.
- ``receive`` (on the GPU machine, once per transfer): installs the wheels once, checks each piece in
  ``.gguf-parts/`` against its manifest and keeps it under WORK (the tokenizer unpacked into WORK/tokenizer); once
  all are there, assembles and decompresses the GGUF and checks the whole file's SHA-256.
- ``run`` (on the GPU machine): installs the wheels into WORK/site, receives any pieces present, dequantises the
  GGUF once into a Hugging Face checkpoint (WORK/base-hf, with the carried tokenizer), then the phases not done
  yet, one after another (each skipped once done, so the same command continues after a stop):

  1. the pilot (``--pilot-samples``): ``tmas rl pilot`` samples every prompt group at each
     ``--pilot-temperature`` (in chunks, for at most ``--pilot-time`` seconds, reporting on the groups reached;
     a chunk still sampling 30 s past that time is stopped and dropped, the chunks finished reported; one
     stopped before any chunk finished reports that and runs again on the next call, unless training has a
     checkpoint by then: it goes on with the rows it began on),
     keeps the groups right ``--min-rate``..``--max-rate`` of the time at the temperature that keeps the most, and
     training reads those rows at that temperature;
  2. the base model's evaluation (CoT prompt, in-process with transformers) on the held-out problems, greedy
     and/or sampled with fixed seeds (``--eval-mode``);
  3. ``tmas rl train``: GRPO with LoRA (groups of ``--num-generations``, ``--steps`` optimizer steps, rollouts by
     continuous batching and in bfloat16 when asked, dynamic sampling with ``--generate-groups``, checkpoints every
     ``--save-steps`` in WORK/lora, ``--resume`` after a stop; the guideline judge of eq. 9 is the frozen base
     model in-process, ``--judge-model``), for at most ``--train-time`` seconds;
  4. the trained adapter's evaluation (same problems, settings and seeds);
  5. the report, and at most eight files copied to ``--out``: the adapter (``adapter.tgz``), ``steps.jsonl``,
     ``rewards.png``, ``eval.png``, ``eval_summary.json`` (with the reward curve's figures and the pilot's report),
     ``report.md``, ``details.tgz`` (per-problem outcomes, per-rollout rewards, the pilot's rates, logs) and
     ``run.log``.

  ``--until prepare`` stops after 2, ``--until train`` after 3. ``--stop-after SECONDS`` bounds the command:
  training stops itself after the step that leaves ``--reserve`` seconds for the trained model's evaluation
  (``tmas rl train --max-time``, a checkpoint of that step kept), and the results so far are still written. The
  files go to ``--out`` once training ends too, before the trained model's evaluation, so that a call ended during
  that evaluation still brings back the adapter and its curve.

``--model tiny`` rehearses the whole path on a CPU with a two-layer model built from a config (no weights, no GPU):

    python benchmarks/rl_device.py run --model tiny --no-wheels --work /tmp/rl-rehearsal --out /tmp/rl-rehearsal/out \\
        --steps 2 --save-steps 1 --num-generations 2 --max-completion-length 8 --eval-limit 6 --eval-max-tokens 8
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".whl"
PARTS_DIR = ROOT / ".gguf-parts"
MANIFEST = "manifest.json"
PIECE_FILE = "piece.bin"
# The GGUF's tokenizer, converted where the pieces are made, travels in piece 00's folder.
TOKENIZER_FILE = "tokenizer.tgz"
TOKENIZER_DIR = "tokenizer"
DEFAULT_WORK = Path("/tmp/tmas-rl")
# What one transfer to the GPU machine may hold in all: the repository's files, which travel every time, and the
# folders carried with them; less room for the repository to grow between ``pack`` and the transfers.
TRANSFER_BYTES = 64 * 2**20
TRANSFER_MARGIN = 2**20
# Seconds of a call kept after the pilot's time: its last chunk's overrun, its report and the next phase's start;
# a pilot still sampling that long after its time is stopped (it reports on the chunks it finished).
PILOT_MARGIN = 30.0
CARRY_HELP = "MB (10^6 bytes) of wheels and pieces one transfer carries (default: 64 MiB less the repository and 1 MiB)"
DEFAULT_DATA = ROOT / "data" / "rl" / "train.parquet"
DEFAULT_EVAL = ROOT / "data" / "rl" / "eval.jsonl"
EMBEDDED = "qwen2.5-coder-0.5b"
# Set in the process that continues with the installed wheels on its path (so it installs and restarts once).
SITE_VARIABLE = "RL_DEVICE_SITE"
# What TRL's GRPO, the rewards' grading and the GGUF reader need beyond an image with CUDA PyTorch, transformers,
# accelerate, numpy, pandas, pyarrow, huggingface-hub, typer, rich, jinja2 and aiohttp. Versions are
# those installed where ``pack`` runs, so the GPU machine runs what the CPU rehearsal ran.
WHEELS = (
    "trl",
    "datasets",
    "dill",
    "multiprocess",
    # datasets caps fsspec below the newest releases; the version installed here is one it accepts.
    "fsspec",
    "gguf",
    "peft",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    # pydantic-core imports names only recent releases have; the image's own version is not known here.
    "typing-extensions",
    "zstandard",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
OUT_FILES = (
    "adapter.tgz",
    "steps.jsonl",
    "rewards.png",
    "eval.png",
    "eval_summary.json",
    "report.md",
    "details.tgz",
    "run.log",
)
EVALS = (("base", "greedy"), ("base", "sampled"), ("trained", "greedy"), ("trained", "sampled"))


# ---------------------------------------------------------------------------------------------------- helpers
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def log(work: Path, text: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {text}"
    print(line, flush=True)
    work.mkdir(parents=True, exist_ok=True)
    with (work / "run.log").open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def child_env(work: Path) -> dict[str, str]:
    """Subprocesses see this repository's src, the carried wheels, and no network."""
    paths = [str(ROOT / "src"), str(work / "site")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


# ------------------------------------------------------------------------------------------------------- pack
def split_file(
    path: Path, dest: Path, piece_bytes: int, first_bytes: int | None = None, attachment: Path | None = None
) -> dict[str, Any]:
    """``path`` gzip-compressed, in pieces of ``piece_bytes`` (the first of ``first_bytes``, where it travels with
    the wheels), ``dest/NN/piece.bin``, each folder with the manifest of all. ``attachment`` (the tokenizer) travels
    in piece 00's folder, its SHA-256 in the manifest."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    compressed = dest / (path.name + ".gz")
    with path.open("rb") as source, gzip.open(compressed, "wb", compresslevel=9) as out:
        shutil.copyfileobj(source, out, 1 << 20)
    pieces = []
    with compressed.open("rb") as handle:
        index = 0
        while chunk := handle.read(first_bytes if index == 0 and first_bytes else piece_bytes):
            folder = dest / f"{index:02d}"
            folder.mkdir(parents=True)
            (folder / PIECE_FILE).write_bytes(chunk)
            pieces.append({"index": index, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
            index += 1
    compressed.unlink()
    manifest: dict[str, Any] = {
        "name": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_of(path),
        "pieces": pieces,
    }
    if attachment is not None:
        shutil.copyfile(attachment, dest / "00" / attachment.name)
        manifest["attachment"] = {"name": attachment.name, "sha256": sha256_of(attachment)}
    for piece in pieces:
        (dest / f"{piece['index']:02d}" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def pack_tokenizer(gguf: Path, dest: Path) -> Path:
    """The GGUF's tokenizer as training reads it (converted by transformers, ending text at the file's end token),
    saved and packed: converting it was nearly all of the 82 s the GPU machine's base checkpoint took on 2026-11-27,
    and it is the same each run."""
    import tempfile

    from tmas.llm.hf_checkpoint import gguf_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        gguf_tokenizer(gguf).save_pretrained(folder)
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(folder, arcname=TOKENIZER_DIR)
    return dest


def download_wheels(dest: Path, names: tuple[str, ...] = WHEELS) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    pinned = [f"{name}=={importlib.metadata.version(name)}" for name in names]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    subprocess.run([*command, "--implementation", "cp", *platforms, "-d", str(dest), *pinned], check=True)
    return pinned


def repository_bytes(root: Path = ROOT) -> int:
    """The size of what travels with every transfer: the repository's tracked files and the untracked ones git does
    not ignore."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=root, capture_output=True, check=True).stdout.decode()
    files = {root / name for name in listed.split("\0") if name}
    return sum(f.stat().st_size for f in files if f.is_file())


def carry_bytes(carry_mb: float | None, root: Path = ROOT) -> int:
    """Bytes of wheels and pieces one transfer carries: ``carry_mb`` MB where given, else what a transfer holds
    beside the repository's own files (:data:`TRANSFER_BYTES`, less them and :data:`TRANSFER_MARGIN`)."""
    if carry_mb is not None:
        return int(carry_mb * 1_000_000)
    return TRANSFER_BYTES - repository_bytes(root) - TRANSFER_MARGIN


def pack(args: argparse.Namespace) -> None:
    import tempfile

    from tmas.llm.weights import resolve_model

    gguf = resolve_model(args.model)
    pinned = download_wheels(WHEEL_DIR)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = pack_tokenizer(gguf, Path(folder) / TOKENIZER_FILE)
        carried = sum(p.stat().st_size for p in WHEEL_DIR.glob("*.whl")) + tokenizer.stat().st_size
        carry = carry_bytes(args.carry_mb)
        if carried >= carry:
            raise SystemExit(f"the wheels and the tokenizer ({carried} bytes) alone exceed a transfer ({carry} bytes)")
        # One transfer each: the wheels and the tokenizer with piece 00, then one piece a transfer.
        manifest = split_file(gguf, PARTS_DIR, carry, first_bytes=carry - carried, attachment=tokenizer)
    packed = {"wheels": pinned, "wheel_and_tokenizer_bytes": carried, "carry_bytes": carry, "gguf": manifest}
    print(json.dumps(packed, indent=1))


# ---------------------------------------------------------------------------------------------------- receive
def receive(work: Path, parts: Path = PARTS_DIR) -> Path | None:
    """Keep every verified piece found in ``parts`` under WORK/parts; the assembled GGUF once all are there."""
    store = work / "parts"
    store.mkdir(parents=True, exist_ok=True)
    done = assembled(work)
    if done is not None:
        return done
    for folder in sorted(parts.glob("*")) if parts.is_dir() else []:
        piece, manifest_file = folder / PIECE_FILE, folder / MANIFEST
        # Pieces of earlier transfers may still be in the folder: each is checked and copied once.
        if not (piece.is_file() and manifest_file.is_file()) or (store / f"{int(folder.name):02d}").is_file():
            continue
        manifest = json.loads(manifest_file.read_text())
        if int(folder.name) == 0:
            receive_tokenizer(work, folder, manifest)
        entry = manifest["pieces"][int(folder.name)]
        if sha256_of(piece) != entry["sha256"]:
            log(work, f"piece {folder.name}: SHA-256 differs from the manifest; not kept")
            continue
        shutil.copyfile(piece, store / f"{int(folder.name):02d}")
        (store / MANIFEST).write_text(manifest_file.read_text())
        log(work, f"piece {folder.name} of {len(manifest['pieces'])} checked and kept")
    return assemble(work)


def receive_tokenizer(work: Path, folder: Path, manifest: dict[str, Any]) -> None:
    """The tokenizer travelling with piece 00, checked and unpacked into WORK/tokenizer (once)."""
    attachment = manifest.get("attachment")
    if attachment is None or (work / TOKENIZER_DIR).is_dir():
        return
    packed = folder / attachment["name"]
    if not packed.is_file() or sha256_of(packed) != attachment["sha256"]:
        log(work, f"{packed.name}: missing or its SHA-256 differs from the manifest; the GGUF's own is converted")
        return
    with tarfile.open(packed) as tar:
        tar.extractall(work, filter="data")
    log(work, f"tokenizer checked and unpacked into {work / TOKENIZER_DIR}")


def assembled(work: Path) -> Path | None:
    """The GGUF, once assembled and checked (its pieces are then deleted)."""
    manifest_file = work / "parts" / MANIFEST
    if not manifest_file.is_file():
        return None
    manifest = json.loads(manifest_file.read_text())
    target: Path = work / manifest["name"]
    return target if target.is_file() and target.stat().st_size == manifest["bytes"] else None


def model_trained(work: Path, spec: str) -> str:
    """The model a run in WORK trains, as the report names it: ``tiny``, a GGUF given by its path, else the carried
    GGUF's file name from its manifest (``--model``'s default names the pieces' source, whatever model they hold)."""
    manifest = work / "parts" / MANIFEST
    if spec == "tiny" or Path(spec).is_file() or not manifest.is_file():
        return spec
    return str(json.loads(manifest.read_text())["name"])


def assemble(work: Path) -> Path | None:
    store = work / "parts"
    if not (store / MANIFEST).is_file():
        return None
    if (done := assembled(work)) is not None:
        return done
    manifest = json.loads((store / MANIFEST).read_text())
    target: Path = work / manifest["name"]
    missing = [p["index"] for p in manifest["pieces"] if not (store / f"{p['index']:02d}").is_file()]
    if missing:
        log(work, f"GGUF incomplete: pieces {missing} still to come")
        return None
    compressed, partial = target.with_suffix(".gz"), target.with_suffix(".partial")
    with compressed.open("wb") as out:
        for p in manifest["pieces"]:
            with (store / f"{p['index']:02d}").open("rb") as handle:
                shutil.copyfileobj(handle, out)
    with gzip.open(compressed, "rb") as source, partial.open("wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    compressed.unlink()
    if sha256_of(partial) != manifest["sha256"]:
        partial.unlink()
        raise SystemExit(f"assembled {manifest['name']}: SHA-256 differs from {manifest['sha256']}")
    partial.rename(target)
    for p in manifest["pieces"]:
        (store / f"{p['index']:02d}").unlink()
    log(work, f"assembled {target} ({manifest['bytes']} bytes, SHA-256 checked)")
    return target


# -------------------------------------------------------------------------------------------------------- run
def install_wheels(work: Path, wheel_dir: Path | None = WHEEL_DIR) -> bool:
    """The carried wheels installed once into WORK/site; True once they are."""
    site, stamp = work / "site", work / "site" / ".installed"
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir is not None else []
    if wheels and not stamp.is_file():
        log(work, f"installing {len(wheels)} wheels into {site}")
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*command, "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        stamp.touch()
    return stamp.is_file()


def ensure_site(work: Path, wheel_dir: Path | None = WHEEL_DIR) -> None:
    """Install the carried wheels once, then continue in a process that sees them."""
    site = work / "site"
    if install_wheels(work, wheel_dir) and os.environ.get(SITE_VARIABLE) != str(site):
        os.execve(sys.executable, [sys.executable, *sys.argv], child_env(work) | {SITE_VARIABLE: str(site)})


def load_problems_file(path: Path, limit: int | None) -> list[Any]:
    from tmas.problems import load_problems

    problems = list(load_problems(path))
    return problems[:limit] if limit else problems


def trained_questions(eval_file: Path, limit: int | None, data: Path) -> list[str]:
    """The ids of the evaluation problems whose question (by the project's question hash: case and spacing aside)
    is a training row's ``extra_info.question``: the before/after evaluation would measure questions trained on."""
    import pyarrow.parquet as pq

    from tmas.problems import question_hash

    infos = pq.read_table(data, columns=["extra_info"]).column("extra_info").to_pylist()
    trained = {question_hash(info["question"]) for info in infos if info and isinstance(info.get("question"), str)}
    return [p.problem_id for p in load_problems_file(eval_file, limit) if question_hash(p.question) in trained]


def ensure_base(work: Path, spec: str, data: Path, eval_file: Path, limit: int | None) -> Path:
    """WORK/base-hf: the model to train and evaluate as a Hugging Face checkpoint, read once. ``tiny`` is built
    from a config with a word-level tokenizer over the training and evaluation texts; a GGUF is dequantised."""
    base = work / "base-hf"
    if (base / "config.json").is_file():
        return base
    partial = work / "base-hf.partial"
    shutil.rmtree(partial, ignore_errors=True)
    if spec == "tiny":
        import datasets

        from tmas.rl.hf_eval import cot_messages
        from tmas.rl.tiny import tiny_model, tiny_tokenizer

        rows = datasets.Dataset.from_parquet(str(data))
        texts = [m["content"] for row in rows for m in row["prompt"]]
        texts += [str(row["reward_model"]["ground_truth"]) for row in rows]
        texts += [m["content"] for p in load_problems_file(eval_file, limit) for m in cot_messages(p)]
        tokenizer = tiny_tokenizer([*texts, "\\boxed{", "}"])
        model = tiny_model(len(tokenizer))
    else:
        from tmas.rl.trl_train import load_policy

        carried = work / TOKENIZER_DIR
        model, tokenizer = load_policy(spec, tokenizer_dir=carried if carried.is_dir() else None)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(base)
    return base


def run_eval(args: argparse.Namespace) -> None:
    """One model (``--which``: base, or trained = base + WORK/lora/final) on the held-out problems, greedy and
    sampled; WORK/eval/WHICH-MODE.jsonl and .summary.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tmas.rl.hf_eval import evaluate
    from tmas.rl.hf_generate import GenerationSettings

    work = args.work
    base = work / "base-hf"
    cuda = torch.cuda.is_available()
    # float32 by default, both models: the adapter's small update is not rounded away in bfloat16 sums.
    dtype = getattr(torch, args.eval_dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if args.which == "trained":
        from peft import PeftModel

        # Merged in float32 (exact to rounding): generation then runs the plain model's kernels, no adapter's.
        model = PeftModel.from_pretrained(model, work / "lora" / "final").merge_and_unload()
    model = model.to("cuda" if cuda else "cpu").eval()
    problems = load_problems_file(args.eval, args.eval_limit)
    out = work / "eval"
    out.mkdir(parents=True, exist_ok=True)
    for mode in eval_modes(args):
        name = f"{args.which}-{mode}"
        if (out / f"{name}.summary.json").is_file():
            continue
        settings = GenerationSettings(
            temperature=0.0 if mode == "greedy" else args.eval_temperature,
            top_p=1.0 if mode == "greedy" else args.eval_top_p,
            max_new_tokens=args.eval_max_tokens,
            seed=args.eval_seed,
            batch_size=args.eval_batch_size,
            engine=args.eval_engine,
        )
        started = time.monotonic()
        outcomes, summary = evaluate(model, tokenizer, problems, settings, name)
        (out / f"{name}.jsonl").write_text("".join(o.model_dump_json() + "\n" for o in outcomes))
        record = summary.model_dump(mode="json") | {"wall_s": round(time.monotonic() - started, 1)}
        (out / f"{name}.summary.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {summary.correct}/{summary.problems} right, cut {summary.cut_rate:.2f}", flush=True)


def eval_command(args: argparse.Namespace, which: str) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "eval", "--which", which, "--work", str(args.work)]
    command += ["--eval", str(args.eval), "--eval-max-tokens", str(args.eval_max_tokens)]
    command += ["--eval-temperature", str(args.eval_temperature), "--eval-top-p", str(args.eval_top_p)]
    command += ["--eval-seed", str(args.eval_seed), "--eval-batch-size", str(args.eval_batch_size)]
    command += ["--eval-dtype", args.eval_dtype, "--eval-engine", args.eval_engine]
    command += [a for mode in eval_modes(args) for a in ("--eval-mode", mode)]
    if args.eval_limit:
        command += ["--eval-limit", str(args.eval_limit)]
    return command


def eval_modes(args: argparse.Namespace) -> list[str]:
    return list(args.eval_mode or ("greedy", "sampled"))


def pilot_paths(work: Path) -> tuple[Path, Path]:
    """The pilot's kept rows and its report (tmas.rl.pilot writes the report beside the rows)."""
    return work / "pilot" / "train.parquet", work / "pilot" / "train.pilot.json"


def pilot_measured(work: Path) -> bool:
    """The pilot has run and measured some groups: a report of a pilot stopped before any chunk of groups finished
    (nothing measured) does not count, and a later call runs the pilot again."""
    report = pilot_paths(work)[1]
    return report.is_file() and int(json.loads(report.read_text()).get("measured_groups", 0)) > 0


def pilot_command(args: argparse.Namespace, base: Path, max_time: float) -> list[str]:
    kept, _ = pilot_paths(args.work)
    command = [sys.executable, "-m", "tmas", "rl", "pilot", str(args.data), "-o", str(kept), "--model", str(base)]
    command += ["--max-time", f"{max(1.0, max_time):.0f}"]
    command += ["--samples", str(args.pilot_samples), "--max-completion-length", str(args.max_completion_length)]
    command += ["--min-rate", str(args.min_rate), "--max-rate", str(args.max_rate), "--seed", str(args.seed)]
    command += ["--engine", "continuous" if args.continuous_batching else "padded", "--dtype", args.dtype]
    command += [a for t in pilot_temperatures(args) for a in ("--temperature", f"{t:g}")]
    return command


def pilot_temperatures(args: argparse.Namespace) -> list[float]:
    return list(args.pilot_temperature or ([args.temperature] if args.temperature else [1.0]))


def training_plan(args: argparse.Namespace) -> tuple[Path, float]:
    """The data training reads and its rollout temperature: the pilot's kept rows and chosen temperature where it
    ran and kept some (--temperature, when given, wins), else --data at --temperature (1.0 when not given)."""
    kept, report = pilot_paths(args.work)
    pilot = json.loads(report.read_text()) if report.is_file() else {}
    # A step generates whole groups only: fewer kept than a step generates could never fill one.
    enough = pilot.get("kept_groups", 0) >= max(args.generate_groups or 0, args.groups_per_step)
    data = kept if kept.is_file() and enough else args.data
    return data, float(args.temperature or pilot.get("chosen_temperature") or 1.0)


def train_command(args: argparse.Namespace, base: Path, judge: bool, max_time: float) -> list[str]:
    from tmas.rl.checkpoints import last_checkpoint

    lora = args.work / "lora"
    data, temperature = training_plan(args)
    command = [sys.executable, "-m", "tmas", "rl", "train", str(data), "--model", str(base), "-o", str(lora)]
    command += ["--max-steps", str(args.steps), "--num-generations", str(args.num_generations)]
    command += ["--max-completion-length", str(args.max_completion_length), "--save-steps", str(args.save_steps)]
    command += ["--lora-rank", str(args.lora_rank), "--learning-rate", str(args.learning_rate), "--no-vllm"]
    command += ["--seed", str(args.seed), "--groups-per-step", str(args.groups_per_step)]
    command += ["--generate-groups", str(max(args.generate_groups or 0, args.groups_per_step))]
    command += ["--gradient-accumulation-steps", str(args.gradient_accumulation_steps)]
    command += ["--temperature", f"{temperature:g}", "--dtype", args.dtype]
    command += ["--continuous-batching" if args.continuous_batching else "--padded-generate"]
    command += ["--max-time", f"{max(0.001, max_time):.3f}"]
    if judge:
        command += ["--judge-model", str(base)]
    if last_checkpoint(lora) is not None:
        command.append("--resume")
    return command


def has_guideline_rows(data: Path) -> bool:
    import pyarrow.parquet as pq

    return "guideline" in set(pq.read_table(data, columns=["_source"]).column("_source").to_pylist())


def stop(process: subprocess.Popen[bytes], work: Path, what: str) -> None:
    """End a phase's process group (training keeps its last checkpoint for --resume)."""
    log(work, f"stopping {what}: out of time")
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start(command: list[str], work: Path, log_name: str) -> subprocess.Popen[bytes]:
    handle = (work / log_name).open("ab")
    return subprocess.Popen(
        command, stdout=handle, stderr=subprocess.STDOUT, env=child_env(work), start_new_session=True
    )


def wait(process: subprocess.Popen[bytes], deadline: float, work: Path, what: str) -> bool:
    """True when the process ended by itself with status 0 before the deadline."""
    while process.poll() is None:
        if time.monotonic() >= deadline:
            stop(process, work, what)
            return False
        time.sleep(1)
    if process.returncode:
        log(work, f"{what} failed with status {process.returncode} (see its log in details.tgz)")
    return process.returncode == 0


def trained(work: Path, steps: int) -> bool:
    """The final adapter is there, with all ``steps`` trained (not one stopped for time)."""
    state = training_state(work)
    return bool(state["final_adapter"]) and int(state["steps_logged"]) >= steps


def evaluated(work: Path, which: str, modes: list[str] | None = None) -> bool:
    wanted = modes or ["greedy", "sampled"]
    return all((work / "eval" / f"{which}-{m}.summary.json").is_file() for m in wanted)


def run(args: argparse.Namespace) -> None:
    """The phases not done yet, one after another, each skipped once done: the base checkpoint, the pilot
    rollouts (--pilot-samples), the base model's evaluation, training, the trained model's evaluation; --until
    stops after a phase, so that a machine held for a few minutes at a time does one part per command."""
    work: Path = args.work
    started = time.monotonic()
    deadline = started + args.stop_after
    leaks = trained_questions(args.eval, args.eval_limit, args.data)
    if leaks:
        raise SystemExit(
            f"--eval {args.eval}: problem {leaks[0]!r} ({len(leaks)} in all) is a question of --data {args.data}:"
            " the evaluation must hold out what training sees (tmas rl build-data --exclude)"
        )
    ensure_site(work, None if args.no_wheels else WHEEL_DIR)
    log(work, f"run: model {args.model}, data {args.data}, eval {args.eval}, until {args.until}, {args.stop_after} s")
    spec = args.model
    if spec != "tiny" and not Path(spec).is_file():
        gguf = receive(work)
        if gguf is None:
            log(work, "no complete GGUF yet: receive the remaining pieces, then run again")
            collect(args)
            return
        spec = str(gguf)
    base = ensure_base(work, spec, args.data, args.eval, args.eval_limit)
    log(work, f"base checkpoint {base} ({time.monotonic() - started:.0f} s)")
    phases: dict[str, Any] = {}
    from tmas.rl.checkpoints import last_checkpoint

    started_training = last_checkpoint(work / "lora") is not None
    if args.pilot_samples and not pilot_measured(work) and started_training:
        # Training resumes on the rows it began with: a pilot now could change them under its checkpoint.
        log(work, "the pilot measured nothing before training began: training goes on with the rows it began on")
    elif args.pilot_samples and not pilot_measured(work):
        # The pilot stops starting chunks of groups in time to report on those it reached, before the call's end.
        # A chunk it cannot finish in time (its first, whose time nothing foretells) is stopped with its margin
        # passed: the pilot then reports on the chunks it finished, and the base evaluation keeps the call's rest.
        max_time = min(args.pilot_time, deadline - time.monotonic() - PILOT_MARGIN)
        until = min(deadline, time.monotonic() + max(1.0, max_time) + PILOT_MARGIN)
        run_phase(phases, "pilot", pilot_command(args, base, max_time), work, until, "the pilot")
        if training_plan(args)[0] != pilot_paths(work)[0]:
            log(work, f"the pilot kept fewer groups than a step generates (pilot.log): training reads {args.data}")
    if not evaluated(work, "base", eval_modes(args)):
        run_phase(phases, "eval-base", eval_command(args, "base"), work, deadline, "the base model's evaluation")
    final = work / "lora" / "final"
    if args.until != "prepare" and not trained(work, args.steps):
        # Training stopped for time by an earlier call goes on from its last step; the adapter changes, so an
        # evaluation of the earlier one is dropped.
        for stale in (work / "eval").glob("trained-*"):
            stale.unlink()
        judge = has_guideline_rows(training_plan(args)[0]) and not args.no_judge
        # Training ends itself after the step that passes its time (its start-up and one step are allowed for);
        # it is stopped, keeping its last checkpoint, only if it runs well past that.
        end = deadline - (args.reserve if args.until == "all" else 0)
        max_time = end - time.monotonic() - args.train_margin
        if args.train_time is not None:
            max_time = min(max_time, args.train_time)
        command = train_command(args, base, judge, max_time)
        log(work, "train: " + " ".join(command[1:]))
        run_phase(phases, "train", command, work, end + args.train_margin / 2, "training")
        if args.until == "all" and args.reserve > 0:
            # The adapter and its curve go to --out before the trained model's evaluation: a call stopped during
            # it (or during the files after it) still brings them back.
            collect(args)
    if args.until != "all" or args.reserve <= 0:
        log(work, f"--until {args.until} --reserve {args.reserve:g}: the trained model is evaluated by a later call")
    elif (final / "adapter_config.json").is_file() and not evaluated(work, "trained", eval_modes(args)):
        what = "the trained model's evaluation"
        run_phase(phases, "eval-trained", eval_command(args, "trained"), work, deadline, what)
    phases["wall_s"] = round(time.monotonic() - started, 1)
    log(work, "phases: " + json.dumps(phases))
    collect(args)


def run_phase(phases: dict[str, Any], name: str, command: list[str], work: Path, deadline: float, what: str) -> bool:
    """One phase's process (its output in WORK/NAME.log) until it ends or the deadline; whether it ended well and
    its seconds noted in ``phases``."""
    t0 = time.monotonic()
    done = wait(start(command, work, f"{name}.log"), deadline, work, what)
    phases[f"{name}_done"], phases[f"{name}_wall_s"] = done, round(time.monotonic() - t0, 1)
    return done


# ---------------------------------------------------------------------------------------------------- results
def read_summaries(work: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for which, mode in EVALS:
        path = work / "eval" / f"{which}-{mode}.summary.json"
        if path.is_file():
            out[f"{which}-{mode}"] = json.loads(path.read_text())
    return out


def read_outcomes(work: Path, name: str) -> dict[str, bool] | None:
    path = work / "eval" / f"{name}.jsonl"
    if not path.is_file():
        return None
    return {row["problem_id"]: row["correct"] for row in map(json.loads, path.read_text().splitlines())}


def comparisons(work: Path) -> dict[str, dict[str, Any]]:
    from tmas.rl.hf_eval import paired_difference

    out = {}
    for mode in ("greedy", "sampled"):
        before, after = read_outcomes(work, f"base-{mode}"), read_outcomes(work, f"trained-{mode}")
        if before is None or after is None or before.keys() != after.keys():
            continue
        ids = sorted(before)
        out[mode] = paired_difference([before[i] for i in ids], [after[i] for i in ids]).model_dump()
    return out


def training_state(work: Path) -> dict[str, Any]:
    from tmas.rl.checkpoints import last_checkpoint
    from tmas.rl.step_log import read_rows

    # A last line cut by the stop at a call's end is left out, as training's --resume leaves it.
    rows = read_rows(work / "lora" / "steps.jsonl")
    last = last_checkpoint(work / "lora")
    return {
        "steps_logged": len(rows),
        "last_checkpoint": last.name if last else None,
        "final_adapter": (work / "lora" / "final" / "adapter_config.json").is_file(),
    }


def reward_curve(steps_file: Path, window: int = 10) -> dict[str, Any] | None:
    """The issue's measures of a run: the mean reward of the first and last ``window`` steps (fewer when the run
    has fewer than twice as many), the mean share of groups without a spread, step time and rollout speed."""
    from tmas.rl.step_log import read_rows

    rows = read_rows(steps_file)
    if not rows:
        return None
    n = max(1, min(window, len(rows) // 2))
    speeds = [r["rollout/generated_tokens_per_s"] for r in rows if r.get("rollout/generated_tokens_per_s")]
    filled = "dynamic/groups_trained_without_spread"
    unspread = [r[filled] for r in rows if filled in r]
    first = sum(r["reward"] for r in rows[:n]) / n
    last = sum(r["reward"] for r in rows[-n:]) / n
    return {
        "steps": len(rows),
        "window": n,
        "first_mean": first,
        "last_mean": last,
        "rise": last - first,
        "zero_std_mean": sum(r.get("frac_reward_zero_std", 0.0) for r in rows) / len(rows),
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "train_s": sum(r["step_s"] for r in rows),
        "generated_tokens_per_s_mean": sum(speeds) / len(speeds) if speeds else None,
        # Dynamic sampling: groups a step trained although their rewards did not differ (too few others).
        "trained_without_spread_mean": sum(unspread) / len(unspread) if unspread else None,
    }


def report_text(summary: dict[str, Any]) -> str:
    lines = ["# GRPO with LoRA: before and after", "", f"Model: `{summary['model']}`; data: `{summary['data']}`.", ""]
    lines += ["| model | decoding | problems | accuracy | std. error | no answer | cut | mean tokens |"]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary["evals"].items():
        which, mode = name.split("-")
        lines.append(
            f"| {which} | {mode} | {s['problems']} | {s['accuracy']:.3f} | {s['stderr']:.3f} | "
            f"{s['no_answer_rate']:.3f} | {s['cut_rate']:.3f} | {s['mean_tokens']:.0f} |"
        )
    for mode, d in summary["paired"].items():
        lines.append(
            f"\nTrained minus base, {mode}: {d['difference']:+.3f} (std. error {d['stderr']:.3f}, paired over"
            f" {d['problems']} problems; {d['gained']} gained, {d['lost']} lost)."
        )
    c = summary.get("curve")
    if c:
        lines.append(
            f"\nReward curve over {c['steps']} steps in {c['train_s']:.0f} s: mean of the first {c['window']}"
            f" {c['first_mean']:+.3f}, of the last {c['window']} {c['last_mean']:+.3f} (a rise of {c['rise']:+.3f});"
            f" groups with one reward for all (frac_reward_zero_std) {c['zero_std_mean']:.2f} on average; a step"
            f" {c['step_s_median']:.1f} s (median); rollouts {c['generated_tokens_per_s_mean'] or 0:.0f} generated"
            " tokens per second of generation."
        )
        if c.get("trained_without_spread_mean") is not None:
            lines.append(
                f"Dynamic sampling: {c['trained_without_spread_mean']:.2f} groups a step trained without a spread"
                " of rewards, on average."
            )
    if summary.get("pilot"):
        pilot = summary["pilot"]
        if pilot.get("chosen_temperature") is None:
            lines.append(f"\nPilot: {pilot.get('stopped') or 'nothing measured'}; {pilot['reason']}.")
        else:
            lines.append(
                f"\nPilot: temperature {pilot['chosen_temperature']:g} chosen ({pilot['reason']}); kept"
                f" {pilot['kept_groups']} groups, {pilot['kept_rows']} of {pilot['rows']} rows."
            )
    t = summary["training"]
    lines.append(
        f"\nTraining: {t['steps_logged']} steps logged, last checkpoint {t['last_checkpoint']}, final adapter"
        f" {'written' if t['final_adapter'] else 'not yet'}. Options: `{json.dumps(summary['options'])}`."
    )
    return "\n".join(lines) + "\n"


def plot_evals(summaries: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(summaries)
    ax.bar(
        names,
        [summaries[n]["accuracy"] for n in names],
        yerr=[summaries[n]["stderr"] for n in names],
        capsize=4,
        color=["#888" if n.startswith("base") else "#2a7" for n in names],
    )
    ax.set_ylabel("accuracy (± 1 std. error)")
    ax.set_title(f"CoT on {next(iter(summaries.values()))['problems']} held-out problems")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The report in WORK, and the eight result files in --out (when given)."""
    work: Path = args.work
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("func",)}
    summaries = read_summaries(work)
    summary = {
        "model": model_trained(work, args.model),
        "data": str(args.data),
        "evals": summaries,
        "paired": comparisons(work),
        "training": training_state(work),
        "curve": reward_curve(work / "lora" / "steps.jsonl"),
        "pilot": json.loads(pilot_paths(work)[1].read_text()) if pilot_paths(work)[1].is_file() else None,
        "options": options,
    }
    (work / "eval_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (work / "report.md").write_text(report_text(summary))
    if summaries:
        plot_evals(summaries, work / "eval.png")
    if args.out is None:
        return summary
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lora = work / "lora"
    final = lora / "final"
    if (final / "adapter_config.json").is_file():
        with tarfile.open(out / "adapter.tgz", "w:gz") as tar:
            tar.add(final, arcname="final")
    for name, source in (
        ("steps.jsonl", lora / "steps.jsonl"),
        ("rewards.png", lora / "rewards.png"),
        ("eval.png", work / "eval.png"),
        ("eval_summary.json", work / "eval_summary.json"),
        ("report.md", work / "report.md"),
        ("run.log", work / "run.log"),
    ):
        if source.is_file():
            shutil.copyfile(source, out / name)
    with tarfile.open(out / "details.tgz", "w:gz") as tar:
        pilot = sorted((work / "pilot").glob("*.pilot.*"))
        for path in [*sorted((work / "eval").glob("*")), lora / "rewards.jsonl", *pilot, *sorted(work.glob("*.log"))]:
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(work)))
    print(report_text(summary), flush=True)
    return summary


# ------------------------------------------------------------------------------------------------------- main
def add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="working folder (keeps state between calls)")
    parser.add_argument("--eval", type=Path, default=DEFAULT_EVAL, help="held-out problems (JSONL)")
    parser.add_argument("--eval-limit", type=int, default=None, help="only the first N held-out problems")
    parser.add_argument("--eval-max-tokens", type=int, default=640, help="tokens per evaluation reply")
    parser.add_argument("--eval-temperature", type=float, default=0.3, help="the sampled evaluation's temperature")
    parser.add_argument("--eval-top-p", type=float, default=0.95, help="the sampled evaluation's top_p")
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the sampled evaluation (both models)")
    parser.add_argument("--eval-batch-size", type=int, default=512, help="prompts per generate call")
    parser.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32", help="evaluation weights")
    parser.add_argument(
        "--eval-mode", action="append", choices=("greedy", "sampled"), help="repeatable; default: greedy and sampled"
    )
    parser.add_argument(
        "--eval-engine", choices=("padded", "continuous"), default="padded", help="padded generate or the engine"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="wheels into .whl/ and the GGUF in pieces into .gguf-parts/ (needs network)")
    p.add_argument("--model", default=EMBEDDED, help="embedded model name or GGUF path")
    p.add_argument("--carry-mb", type=float, help=CARRY_HELP)
    p.set_defaults(func=pack)

    p = sub.add_parser(
        "receive", help="install the wheels; keep the checked GGUF pieces (assembled when all are there)"
    )
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.set_defaults(func=lambda a: (install_wheels(a.work), receive(a.work)))

    p = sub.add_parser("run", help="train and evaluate (continues after a stop)")
    add_eval_options(p)
    p.add_argument("--out", type=Path, default=None, help="folder for the eight result files (the ones to copy back)")
    p.add_argument("--model", default=EMBEDDED, help="'tiny' to rehearse on a CPU; else a GGUF (default: pieces)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="parquet from 'tmas rl build-data'")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all (a call stopped for time goes on)")
    p.add_argument("--num-generations", type=int, default=8, help="rollouts per prompt group")
    p.add_argument("--max-completion-length", type=int, default=256, help="tokens per training rollout")
    p.add_argument("--groups-per-step", type=int, default=4, help="prompt groups per optimizer step")
    p.add_argument(
        "--generate-groups", type=int, default=None, help="groups generated per step; more: dynamic sampling (DAPO)"
    )
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument(
        "--temperature", type=float, default=None, help="rollout temperature (default: the pilot's choice, else 1)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the policy's weights")
    p.add_argument(
        "--continuous-batching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rollouts (and the pilot's) by transformers' continuous-batching engine",
    )
    p.add_argument(
        "--pilot-samples", type=int, default=0, help="pilot rollouts per prompt group before training (0: none)"
    )
    p.add_argument("--pilot-temperature", type=float, action="append", help="the pilot's temperatures (repeatable)")
    p.add_argument(
        "--pilot-time", type=float, default=180.0, help="seconds the pilot may take, its loading included (at most)"
    )
    p.add_argument("--min-rate", type=float, default=0.1, help="train on groups right at least this often")
    p.add_argument("--max-rate", type=float, default=0.9, help="... and at most this often (in the pilot)")
    p.add_argument("--train-time", type=float, default=None, help="seconds of training at most (its --max-time)")
    p.add_argument(
        "--until",
        choices=("prepare", "train", "all"),
        default="all",
        help="prepare: base checkpoint, pilot, base evaluation; train: and training; all: and the trained evaluation",
    )
    p.add_argument("--save-steps", type=int, default=5, help="a checkpoint every this many steps")
    p.add_argument("--lora-rank", type=int, default=4, help="LoRA rank (4: the adapter is about 9 MB)")
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p.add_argument("--no-wheels", action="store_true", help="use the packages installed here, not .whl/")
    p.add_argument("--no-judge", action="store_true", help="no in-process judge (guideline rows need one)")
    p.add_argument("--stop-after", type=float, default=540, help="seconds this command may take")
    p.add_argument(
        "--reserve",
        type=float,
        default=150,
        help="seconds kept after training for the trained model's evaluation; 0: train only (a later call evaluates)",
    )
    p.add_argument(
        "--train-margin", type=float, default=50, help="seconds allowed for training's start-up and its last step"
    )
    p.set_defaults(func=run)

    p = sub.add_parser("eval", help="(used by run) evaluate one model, greedy and sampled")
    add_eval_options(p)
    p.add_argument("--which", choices=("base", "trained"), required=True)
    p.set_defaults(func=run_eval)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    # This checkout's tmas, whether or not it is installed.
    sys.path.insert(0, str(ROOT / "src"))
    args = parse_args(argv)
    if getattr(args, "work", None) is not None:
        args.work = args.work.resolve()
    args.func(args)


if __name__ == "__main__":
    main()
