"""Fine-tune, then serve: a rank-16 LoRA trained with PEFT on the CPU over the default model
(SmolLM2-135M-Instruct), saved in PEFT's format, then served by tachyllm and checked against PEFT itself.

The task is a fixed JSON shape: from a sentence about a person, answer exactly
` {"name": ..., "age": ..., "city": ...}` and stop. The data is generated here, deterministically; the
held-out prompts use names, cities and one sentence form that training never saw. The task score of a
model is the share of held-out prompts whose greedy answer (up to the end-of-sequence token) parses as
exactly the expected object.

transformers loads the base model from the same GGUF file tachyllm uses, dequantized (as tachyllm does
without --quantization gguf), and PEFT trains the adapter in fp32 over it. Then, on the held-out prompts:

- identity: tachyllm (`LLM(enable_lora=True, dtype="float32")`, the adapter's requests and the base
  model's in one batch) against PEFT's greedy argmax loop, token for token over --max-tokens tokens
  (the end-of-sequence token does not stop either); a divergence is reported with PEFT's top-2 logit
  margin at that token (a near-tie, margin < 0.1, is rounding, not a bug);
- task score, base model and adapter, in PEFT and in tachyllm; and in tachyllm over the GGUF-quantized
  base (`quantization="gguf"`: the Q4_1 blocks kept packed, the adapter unmerged on top of them);
- with --serve, `tachy serve --enable-lora --lora-modules json=ADAPTER`: completions on the prompts' token
  ids, for `model` "json" and for the base model, stopping at EOS; their text against PEFT's answers.

Needs peft (the `lora-bench` extra: `pip install peft==0.21.2`).

    .venv/bin/python benchmarks/lora_train_check.py [--threads 2] [--steps 24] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tachyllm import LLM, SamplingParams
from tachyllm.loading.default_model import default_model_path
from tachyllm.lora.request import LoRARequest

DEFAULT_OUT = Path(os.environ.get("TACHY_BENCH_CACHE", Path.home() / ".cache" / "tachyllm-bench")) / "lora-json-shape"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIRST = [
    "Maria", "Jonas", "Aiko", "Pedro", "Lena", "Omar", "Sofia", "Tariq", "Greta", "Kwame", "Ines", "Viktor",
    "Nadia", "Ravi", "Elena", "Hugo", "Priya", "Lars", "Amara", "Felix", "Yusuf", "Clara", "Mateo", "Hana",
]  # fmt: skip
LAST = [
    "Lopez", "Berg", "Tanaka", "Silva", "Novak", "Haddad", "Rossi", "Khan", "Larsen", "Mensah", "Duarte",
    "Petrov", "Okafor", "Sharma", "Costa", "Weber", "Nair", "Lind", "Bello", "Roth", "Demir", "Moreau",
]  # fmt: skip
CITIES = [
    "Lyon", "Oslo", "Kyoto", "Porto", "Prague", "Beirut", "Turin", "Lahore", "Aarhus", "Accra", "Lisbon",
    "Kazan", "Lagos", "Pune", "Madrid", "Bremen", "Bergen", "Quito", "Hanoi", "Cusco", "Tartu", "Split",
    "Graz", "Leeds", "Dakar", "Perth", "Bonn", "Riga", "Basel", "Osaka",
    "Kochi", "Malmo", "Nairobi", "Zurich", "Izmir", "Nantes", "Tunis", "Cork", "Delft", "Fes",
]  # fmt: skip
TEMPLATES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, {age}, lives in {city}.",
    "Living in {city}, {name} turned {age} this year.",
    "{name} ({age}) moved to {city} last spring.",
    "Meet {name} from {city}, who is {age}.",
]
HELD_OUT_TEMPLATE = "At {age}, {name} still works in {city}."
HELD_OUT = 0.25  # the share of first names, last names and cities kept out of training


@dataclass
class Example:
    prompt: str
    answer: dict

    @property
    def answer_text(self) -> str:
        return " " + json.dumps(self.answer)


def make_examples(count: int, held_out: bool, seed: int) -> list[Example]:
    """`count` examples; held-out ones draw from names and cities training never sees, and a sentence
    form of their own beside the training ones."""
    rng = random.Random(seed)

    def split(values: list[str]) -> list[str]:
        cut = int(len(values) * (1 - HELD_OUT))
        return values[cut:] if held_out else values[:cut]

    first, last, cities = split(FIRST), split(LAST), split(CITIES)
    templates = [*TEMPLATES, HELD_OUT_TEMPLATE] if held_out else TEMPLATES
    examples = []
    for _ in range(count):
        answer = {
            "name": f"{rng.choice(first)} {rng.choice(last)}",
            "age": rng.randint(18, 90),
            "city": rng.choice(cities),
        }
        sentence = rng.choice(templates).format(**answer)
        examples.append(Example(f"Text: {sentence}\nJSON:", answer))
    return examples


def score(texts: list[str], examples: list[Example]) -> tuple[float, float]:
    """(exact answers, answers of the right shape: a JSON object with exactly the three keys), as shares."""
    exact = shape = 0
    for text, ex in zip(texts, examples, strict=True):
        try:
            got = json.loads(text)
        except json.JSONDecodeError:
            continue
        shape += isinstance(got, dict) and sorted(got) == ["age", "city", "name"]
        exact += got == ex.answer
    return exact / len(examples), shape / len(examples)


def encode(tokenizer, ex: Example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids + EOS): the prompt is tokenized on its own, as it is served."""
    prompt = tokenizer(ex.prompt)["input_ids"]
    return prompt, tokenizer(ex.answer_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def train(model, tokenizer, args, out: Path) -> dict:
    """Trains the adapter on generated examples and saves it in PEFT's format under `out`."""
    import peft

    config = peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    torch.manual_seed(args.seed)
    model = peft.get_peft_model(model, config)
    model.train()
    examples = make_examples(args.steps * args.batch, held_out=False, seed=args.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.1, 1 - step / args.steps)
    )
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        batch = [encode(tokenizer, ex) for ex in examples[step * args.batch : (step + 1) * args.batch]]
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), width), tokenizer.eos_token_id)
        labels = torch.full((len(batch), width), -100)  # the loss is on the answer only
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, a) in enumerate(batch):
            ids[row, : len(p) + len(a)] = torch.tensor(p + a)
            labels[row, len(p) : len(p) + len(a)] = torch.tensor(a)
            mask[row, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  {time.perf_counter() - start:.0f} s", flush=True)
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out)
    tail = losses[-5:]
    info = {"train_seconds": seconds, "steps": args.steps, "batch": args.batch, "lr": args.lr, "rank": args.rank,
            "threads": args.threads, "first_loss": losses[0], "last_loss": sum(tail) / len(tail)}  # fmt: skip
    (out / "training.json").write_text(json.dumps(info, indent=2))
    return info


def greedy_with_margins(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """PEFT's model's argmax loop (the end-of-sequence token does not stop it) and each token's top-2
    logit margin."""
    tokens, margins = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            logits = out.logits[0, -1].float()
            top2 = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            margins.append((top2[0] - top2[1]).item())
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def answer_text(tokenizer, ids: list[int]) -> str:
    end = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else len(ids)
    return tokenizer.decode(ids[:end])


def compare(name: str, ours: list[list[int]], ref: list[list[int]], margins: list[list[float]]) -> int:
    """Prints each divergence with the reference's margin; returns the prompts identical over all tokens."""
    identical = 0
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        if same == len(b):
            identical += 1
        else:
            print(f"  {name} prompt {i}: diverges at token {same}: {a[same]} vs PEFT {b[same]} "
                  f"(PEFT's top-2 margin there {margins[i][same]:.4f})")  # fmt: skip
    return identical


def served_answers(args, model_path: str, adapter: Path, prompts: list[list[int]]) -> dict[str, list[str]]:
    """Greedy answers (stopping at EOS) from `tachy serve --enable-lora --lora-modules json=ADAPTER`, for
    the base model and the adapter."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", model_path, "--dtype", "float32",
               "--port", str(port), "--served-model-name", "base", "--enable-lora", "--lora-modules", f"json={adapter}",
               "--kv-cache-memory", str(256 << 20)]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    server = subprocess.Popen(command)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tachy serve did not start")
            time.sleep(1)
        results = {}
        for model in ("base", "json"):
            body = {"model": model, "prompt": prompts, "max_tokens": args.max_tokens, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            results[model] = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
        return results
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the adapter is saved")
    parser.add_argument("--retrain", action="store_true", help="train even if --out holds an adapter")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=int, default=24, help="held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve", action="store_true", help="also check `tachy serve --lora-modules`")
    args = parser.parse_args()
    import peft
    import transformers

    torch.set_num_threads(args.threads)
    model_path = default_model_path()
    directory, name = os.path.split(model_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if args.retrain or not (args.out / "adapter_model.safetensors").is_file():
        info = train(base, tokenizer, args, args.out)
        model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32), args.out
        )
    else:
        info = json.loads((args.out / "training.json").read_text())
        model = peft.PeftModel.from_pretrained(base, args.out)
    model.eval()
    print(f"adapter: {args.out} (trained in {info['train_seconds']:.0f} s, {info['steps']} steps of {info['batch']}, "
          f"{info['threads']} threads; loss {info['first_loss']:.3f} -> {info['last_loss']:.3f})")  # fmt: skip

    examples = make_examples(args.held_out, held_out=True, seed=args.seed + 1)
    prompts = [encode(tokenizer, ex)[0] for ex in examples]
    start = time.perf_counter()
    ref: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
    for mode in ("base", "adapter"):
        greedy = []
        for p in prompts:
            if mode == "base":
                with model.disable_adapter():
                    greedy.append(greedy_with_margins(model, p, args.max_tokens))
            else:
                greedy.append(greedy_with_margins(model, p, args.max_tokens))
        ref[mode] = ([g[0] for g in greedy], [g[1] for g in greedy])
    print(f"PEFT reference: {time.perf_counter() - start:.0f} s")
    del model, base

    lora = LoRARequest("json", 1, str(args.out))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ours: dict[str, dict[str, list[list[int]]]] = {}
    for weights in ("fp32", "gguf"):
        llm = LLM(model_path, dtype="float32", quantization="gguf" if weights == "gguf" else None, enable_lora=True,
                  max_lora_rank=args.rank, kv_cache_memory=256 << 20, threads=args.threads)  # fmt: skip
        outputs = llm.generate(prompts * 2, params, lora_request=[None] * len(prompts) + [lora] * len(prompts))
        ids = [o.outputs[0].token_ids for o in outputs]
        ours[weights] = {"base": ids[: len(prompts)], "adapter": ids[len(prompts) :]}
        del llm
    served = served_answers(args, model_path, args.out, prompts) if args.serve else None

    rows = []
    for mode in ("base", "adapter"):
        exact, shape = score([answer_text(tokenizer, r) for r in ref[mode][0]], examples)
        rows.append(f"| {mode} | PEFT / transformers | – | {exact:.0%} | {shape:.0%} |")
        for weights, runs in ours.items():
            exact, shape = score([answer_text(tokenizer, r) for r in runs[mode]], examples)
            same = (
                "–" if weights == "gguf" else f"{compare(f'{weights} {mode}', runs[mode], *ref[mode])}/{len(prompts)}"
            )
            engine = "tachyllm, Q4_1 base kept packed" if weights == "gguf" else f"tachyllm ({weights})"
            rows.append(f"| {mode} | {engine} | {same} | {exact:.0%} | {shape:.0%} |")
        if served is not None:
            texts = served["json" if mode == "adapter" else "base"]
            matching = sum(t == answer_text(tokenizer, r) for t, r in zip(texts, ref[mode][0], strict=True))
            exact, shape = score(texts, examples)
            rows.append(
                f"| {mode} | tachy serve (fp32), answer text | {matching}/{len(prompts)} | {exact:.0%} | {shape:.0%} |"
            )
    print(
        f"\nheld-out prompts: {len(prompts)}, greedy, {args.max_tokens} tokens (EOS not stopping), fp32 unless said\n"
    )
    print("| model | engine | identical to PEFT (all tokens) | exact answers | right JSON shape |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print("\na base answer:", repr(answer_text(tokenizer, ours["fp32"]["base"][0])))
    print("the adapter's answers that are not exact (tachyllm, fp32):")
    for ex, ids in zip(examples, ours["fp32"]["adapter"], strict=True):
        if score([text := answer_text(tokenizer, ids)], [ex])[0] < 1:
            print(f"  {ex.prompt!r}: {text!r}")


if __name__ == "__main__":
    main()
