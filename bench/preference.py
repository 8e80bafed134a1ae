"""DPO: a training step at 4k tokens per pair, cuboid's ``dpo`` task against TRL 1.16's ``DPOTrainer``, in one
run on this machine: peak memory and pairs/s.

The policy is a random Qwen2-shaped model (a Hugging Face folder both load: grouped-query attention, q/k/v
biases, tied embeddings, a 16k vocabulary; a byte-level BPE tokenizer trained on the tests' sentences). Each
pair is a 512-token prompt with a chosen and a rejected answer, each sequence cut to 2048 tokens (4,096
tokens a pair). Both sides precompute the reference's log-probabilities before training (TRL's
``precompute_ref_log_probs=True``: no second model in memory during the steps), run in fp32 with AdamW
(lr 1e-6, clipping at 1.0), one pair a step, sigmoid loss at beta 0.1. TRL runs its defaults otherwise
(gradient checkpointing on, its fused LM head); cuboid runs ``cuboid.train_step`` with the task, once with
plan ``single`` and once with full activation checkpointing.

Each side runs in a subprocess of its own; peak memory is the peak of RssAnon (anonymous resident memory,
/proc/self/status), sampled every millisecond by a thread over the training steps, less the process's RssAnon
before the model was built. Steps after the first (warm-up) are timed with ``time.perf_counter``; pairs/s is
one over the median timed step (the machine may be shared: every step's time is in the JSON).

    python bench/preference.py [--steps 3] [--threads 2] [--out bench/preference.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT, SEQ, PAIRS = 512, 2048, 8
SHAPE = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=704, vocab_size=16000)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakAnon:
    """Peak RssAnon (bytes) of this process while ``active``, sampled every millisecond by a thread."""

    def __init__(self):
        self.peak, self.active, self._stop = 0, False, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            if self.active:
                self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def stop(self):
        self._stop = True
        self._thread.join()


def make_folder(folder: Path) -> Path:
    """The policy folder and a pairs jsonl file of ``PAIRS`` pairs (prompts of ``PROMPT`` tokens, answers
    longer than the sequences' ``SEQ`` tokens)."""
    import torch
    import transformers as T

    sys.path.insert(0, str(ROOT))
    from tests.front.fixtures import WORDS, bpe_tokenizer

    tok = bpe_tokenizer(folder)
    cfg = T.Qwen2Config(max_position_embeddings=SEQ, tie_word_embeddings=True, pad_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, **SHAPE)
    torch.manual_seed(0)
    T.Qwen2ForCausalLM(cfg).save_pretrained(str(folder))
    rng = random.Random(0)

    def text(tokens: int) -> str:
        words = []
        while len(tok(" ".join(words))["input_ids"]) < tokens:
            words += [rng.choice(WORDS) for _ in range(64)]
        ids = tok(" ".join(words))["input_ids"][:tokens]
        return tok.decode(ids)

    with open(folder / "pairs.jsonl", "w") as f:
        for _ in range(PAIRS):
            f.write(json.dumps({"prompt": text(PROMPT), "chosen": " " + text(SEQ), "rejected": " " + text(SEQ)}) + "\n")
    return folder


def run_cuboid(folder: Path, steps: int, checkpoint: bool) -> dict:
    import datasets
    import torch

    import cuboid
    from cuboid.data.formats import GlobalBatches, load_tokenizer
    from cuboid.tasks import get

    base = rss_anon()
    peak = PeakAnon()
    model = cuboid.load(str(folder), "checkpoint=full" if checkpoint else None)
    task = get("dpo")(beta=0.1)
    ds = datasets.load_dataset("json", data_files=str(folder / "pairs.jsonl"), split="train")
    data = task.rows(ds, config=model.config, tokenizer=load_tokenizer(str(folder)), seq_len=SEQ)
    data = task.with_model(model, [data], device=torch.device("cpu"))[0]
    from cuboid.parallel import optim

    opt = optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    batches = GlobalBatches(data, 1, seed=0, width_multiple=8)
    times = []
    peak.active = True
    for step in range(steps + 1):
        batch = task.before_step(batches.next(), step + 1)
        t0 = time.perf_counter()
        cuboid.train_step(model, opt, batch, task=task, max_grad_norm=1.0)
        times.append(time.perf_counter() - t0)
    peak.active = False
    peak.stop()
    return {"side": "cuboid" + (" (checkpoint=full)" if checkpoint else ""), "step_s": times[1:],
            "tokens_per_pair": int(data["attention_mask"][0].sum()), "peak_anon": peak.peak - base}


def run_trl(folder: Path, steps: int) -> dict:
    import datasets
    import transformers as T
    from trl import DPOConfig, DPOTrainer

    base = rss_anon()
    peak = PeakAnon()
    times: list = []

    class Timer(T.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            peak.active = True

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    ds = datasets.load_dataset("json", data_files=str(folder / "pairs.jsonl"), split="train")
    args = DPOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=1, max_steps=steps + 1,
                     learning_rate=1e-6, max_length=SEQ, precompute_ref_log_probs=True, use_cpu=True, bf16=False,
                     report_to="none", save_strategy="no", logging_steps=1000, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = DPOTrainer(model=T.AutoModelForCausalLM.from_pretrained(folder), args=args, train_dataset=ds,
                         processing_class=T.AutoTokenizer.from_pretrained(folder), callbacks=[Timer()])
    trainer.train()
    peak.active = False
    peak.stop()
    return {"side": "trl", "step_s": times[1:], "peak_anon": peak.peak - base,
            "gradient_checkpointing": args.gradient_checkpointing}


def child(which: str, folder: str, steps: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    folder = Path(folder)
    if which == "trl":
        out = run_trl(folder, steps)
    else:
        out = run_cuboid(folder, steps, which == "cuboid-checkpoint")
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per side (default 2)")
    p.add_argument("--out", default=str(ROOT / "bench" / "preference.json"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.steps, args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp))
        for which in ("trl", "cuboid", "cuboid-checkpoint"):
            env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
            proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--threads",
                                   str(args.threads), "--child", which, str(folder)], capture_output=True, text=True,
                                  env=env, cwd=tmp)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1][7:]))
    trl = results[0]
    load = os.getloadavg()[0]
    print(f"DPO step, {SEQ} tokens a sequence (two a pair), {SHAPE}, {args.steps} timed steps, "
          f"{args.threads} threads a side, load average {load:.1f} on {os.cpu_count()} cores at the end\n")
    print("| side | pairs/s | peak RssAnon (MB) | speed vs TRL | memory vs TRL |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        r["pairs_per_s"] = 1.0 / statistics.median(r["step_s"])  # one pair a step; the median step
        print(f"| {r['side']} | {r['pairs_per_s']:.3f} | {r['peak_anon'] / 2**20:.0f} | "
              f"{r['pairs_per_s'] / trl['pairs_per_s']:.2f}x | {r['peak_anon'] / trl['peak_anon']:.2f}x |")
    Path(args.out).write_text(json.dumps({"shape": SHAPE, "seq": SEQ, "prompt": PROMPT, "steps": args.steps,
                                          "threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
