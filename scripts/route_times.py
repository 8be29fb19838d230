"""Each kernel route's time for all the linear products of one pass of the default model, at several row counts.

    python scripts/route_times.py [--rows 1 2 4 8 12 16] [--dtypes bfloat16 float32] [--rounds 5]

The products of SmolLM2-135M's pass (per layer q/k/v fused, o, gate/up fused, down; then lm_head) over random
weights of their shapes, every route over the same inputs, best of `rounds` (ms, one process).
"""

import argparse
import time

import torch
from transformers import AutoConfig

from medusa_heads import speed
from medusa_heads.default import default_base_dir


def shapes() -> list[tuple[int, int]]:
    """(outputs, inputs) of each product of a pass."""
    c = AutoConfig.from_pretrained(default_base_dir())
    head = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head
    layer = [(qkv, c.hidden_size), (c.hidden_size, c.num_attention_heads * head),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    products = shapes()
    for name in args.dtypes:
        dtype = getattr(torch, name)
        weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in products]
        routes = [r for r in ("stream", "columns", "packed", "aten") if speed._works(speed.ROUTES[r], weights[0], None)]
        print(f"{name}: ms for {len(products)} products | rows " + " ".join(f"{r:>7}" for r in args.rows))
        for route in routes:
            fn, times = speed.ROUTES[route], []
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in products}}
                best = float("inf")
                with torch.inference_mode():
                    for _ in range(args.rounds):
                        start = time.perf_counter()
                        for w in weights:
                            fn(inputs[w.shape[1]], w, None)
                        best = min(best, time.perf_counter() - start)
                times.append(best * 1000)
            print(f"{name} {route:>8}" + " " * 13 + " ".join(f"{t:7.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
