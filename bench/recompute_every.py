"""Choose the default recompute segment length K (``recompute_every``) by measurement.

For K in 1, 2, 4: median step time (3 steps after 1 warm-up) and the peak bytes of saved block
inputs the engine keeps, on a 12-layer Llama (hidden 512, batch 2 x 512 tokens, fp32, CPU,
2 threads), driven through the StreamingEngine directly. Prints a table, writes
bench/results/recompute_every.json.

    python bench/recompute_every.py
"""

import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from megatrain_lightning.engine.streaming import StreamingEngine


def run(k: int, steps: int = 4):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=12,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    eng = StreamingEngine(model, torch.device("cpu"), recompute_every=k)
    eng.install()
    eng.attach_optimizer(torch.optim.AdamW(model.parameters()))
    ids = torch.randint(0, 8192, (2, 512))
    times, kept = [], 0
    for i in range(steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        kept = sum(t.numel() * t.element_size() for c in eng.boundary.fwd.live_calls() for t in c.saved
                   if t is not None and t.requires_grad)
        loss.backward()
        eng.attach_grads()
        eng.step()
        eng.end_step()
        if i:
            times.append(time.perf_counter() - t0)
    eng.close()
    return {"k": k, "median_step_s": statistics.median(times), "saved_input_bytes": kept}


def main():
    torch.set_num_threads(2)
    rows = [run(k) for k in (1, 2, 4)]
    base = rows[0]["median_step_s"]
    print(f"{'K':>2} {'step s':>8} {'vs K=1':>7} {'saved inputs':>13}")
    for r in rows:
        r["ratio"] = r["median_step_s"] / base
        print(f"{r['k']:>2} {r['median_step_s']:>8.3f} {r['ratio']:>7.2f} {r['saved_input_bytes'] / 2**20:>10.1f} MiB")
    out = Path(__file__).parent / "results" / "recompute_every.json"
    out.write_text(json.dumps({"bench": "recompute_every", "rows": rows, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
