"""GPU check (run by scripts/gpu_check.sh): exactness and speed of the decoding loop on one CUDA device.

The default model's weights are too large to travel to a lent GPU machine, so this uses a random
model of SmolLM2-135M's shape in bfloat16 with random heads: the speeds and the cost curve c(n) are
the device's; accepted lengths are not meaningful (random heads), exactness is. Last, the same with
compiled decoding passes (`MedusaModel.compile_decoding()`).
"""

import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from medusa_heads import MedusaModel, Tree
from medusa_heads.calibrate import best_trees, cost_curve


def tokens_per_second(run, new_tokens: int, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return new_tokens / sorted(times)[len(times) // 2]


def main(out: str) -> None:
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                  max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda", torch.bfloat16).eval()
    base.generation_config.eos_token_id = None  # random weights: decode exactly `new` tokens everywhere
    model = MedusaModel.from_pretrained(base, num_heads=4, projection="shared")
    ids = torch.randint(100, 40000, (1, 64), generator=torch.Generator().manual_seed(0))
    new = 128
    hf = base.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=new,
                       do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "new_tokens": new}
    trees = {"plain": "plain", "default": None, "reference": "reference", "chain-4": "chain-4"}
    outputs = {name: model.generate(ids, max_new_tokens=new, tree=tree, eos_token_id=[])
               for name, tree in trees.items()}
    results["identical_to_hf"] = {name: o.new_tokens[0] == hf for name, o in outputs.items()}
    results["tokens_per_second"] = {
        "hf": tokens_per_second(lambda: base.generate(ids.cuda(), max_new_tokens=new, do_sample=False,
                                                       pad_token_id=0), new),
        **{name: tokens_per_second(lambda t=tree: model.generate(ids, max_new_tokens=new, tree=t, eos_token_id=[]), new)
           for name, tree in trees.items()},
    }
    results["mean_accepted_length_random_heads"] = {n: o.mean_accepted_length for n, o in outputs.items()}
    sizes = [1, 4, 8, 16, 32, 64, 128]
    flat = [[0.5] * 10 for _ in range(4)]  # any accuracies: only the tree sizes matter for c(n)
    candidates = best_trees(flat, max(sizes))
    costs = cost_curve(model, ids.cuda(), [candidates[n][0] for n in sizes])
    results["cost_curve"] = dict(zip(map(str, sizes), costs, strict=True))
    results["batch"] = {}
    for batch in (1, 8, 32):
        prompts = torch.randint(100, 40000, (batch, 64), generator=torch.Generator().manual_seed(batch))
        results["batch"][str(batch)] = {
            name: tokens_per_second(lambda t=tree, p=prompts: model.generate(p, max_new_tokens=new, tree=t,
                                                                             eos_token_id=[]), new * batch, repeats=1)
            for name, tree in (("plain", "plain"), ("default", Tree.load("default")))}
    model.compile_decoding()  # torch.compile'd verification passes: exact too, and how much faster
    results["compiled"] = {}
    for name, tree in (("plain", "plain"), ("default", None)):
        first = model.generate(ids, max_new_tokens=new, tree=tree, eos_token_id=[])  # this run compiles
        results["compiled"][name] = {
            "identical_to_hf": first.new_tokens[0] == hf,
            "tokens_per_second": tokens_per_second(lambda t=tree: model.generate(ids, max_new_tokens=new, tree=t,
                                                                                 eos_token_id=[]), new)}
    results["identical_to_hf"].update({f"compiled {n}": r["identical_to_hf"] for n, r in results["compiled"].items()})
    text = json.dumps(results, indent=2)
    print(text)
    with open(f"{out}/gpu_check.json", "w") as f:
        f.write(text + "\n")
    if not all(results["identical_to_hf"].values()):
        sys.exit("greedy output differs from transformers on the GPU")


if __name__ == "__main__":
    main(sys.argv[1])
