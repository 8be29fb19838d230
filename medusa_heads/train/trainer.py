"""Training Medusa heads (Medusa-1, frozen backbone) or heads + LoRA backbone (Medusa-2), or an EAGLE-style
draft (frozen backbone), on accelerate.

One loop for both modes. `accelerate launch` or `torchrun` runs the same code on several devices
(DDP through `Accelerator.prepare`); each process takes its shard of every epoch's shuffled order.
A checkpoint (accelerate state + position in the data) is written every `checkpoint_every` steps
and at each epoch's end; `resume=True` continues from it without repeating or skipping a batch.
Medusa-1 can cache the frozen backbone's hidden states on disk once, so epochs cost only the heads.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

from .. import adapter
from ..calibrate import Record
from ..io import save_heads
from ..model import DRAFTS, MedusaModel
from ..settings import setting
from .data import IGNORE, Example, read_conversations, tokenize
from .losses import distill_kl, eagle_loss, heads_loss, lm_loss

MODES = ("medusa1", "medusa2")
EAGLE_EVAL_DEPTHS = 4  # an EAGLE draft's held-out accuracy is reported at these many depths


@dataclass
class TrainConfig:
    """How heads are trained; each field's help is the CLI's (`medusa train`)."""

    draft: str = setting("medusa", "medusa: Medusa heads; eagle: an EAGLE-style draft (one decoder layer run "
                         "autoregressively over the base's features; frozen backbone)", DRAFTS)
    mode: str = setting("medusa1", "medusa1: heads on a frozen backbone; medusa2: heads + a LoRA-tuned backbone",
                        MODES)
    num_heads: int = setting(4, "heads: head k guesses the token k+1 places ahead")
    num_layers: int = setting(1, "residual blocks per head")
    projection: str = setting("own", "each head's own vocabulary projection, or the base lm_head shared",
                              ("own", "shared"))
    draft_vocab: int = setting(0, "shared projection (or an EAGLE draft): propose only the N most frequent answer "
                                  "tokens (cheaper)")
    next_token: bool = setting(False, "heads also read the base model's next token (more accurate; native format only)")
    chained: bool = setting(False, "each head also reads the candidates of the heads before it (implies --next-token)")
    epochs: int = setting(2, "passes over the data")
    lr: float = setting(1e-3, "heads' learning rate (Medusa-1); the backbone's (Medusa-2)")
    batch_size: int = setting(8, "conversations per optimiser step, over all processes")
    max_length: int = setting(1024, "tokens per conversation, the rest is cut")
    decay: float = setting(0.8, "head k's loss weight is decay**k")
    warmup_ratio: float = setting(0.05, "linear warm-up share of all steps, then cosine decay")
    eval_fraction: float = setting(0.05, "held-out share for per-head accuracy")
    seed: int = setting(0, "seed of the split, the initialisation and the data order")
    bf16: bool = setting(False, "training steps' products in bfloat16 (autocast; weights and optimiser stay float32; "
                                "1.6x faster measured on a CPU with AVX512-BF16)")
    cache_hidden: bool = setting(True, "Medusa-1: compute backbone hidden states once, reuse them every epoch")
    hidden_cache: str = setting("", "where the hidden states are cached (default OUT/hidden-cache; another run's "
                                    "folder reuses its states: heads and an EAGLE draft trained on the same data)")
    checkpoint_every: int = setting(200, "optimiser steps between checkpoints")
    skip_bad: bool = setting(False, "skip malformed records (counted) instead of stopping")
    heads_lr_multiplier: float = setting(4.0, "Medusa-2: heads learn this much faster than the backbone")
    head_loss_weight: float = setting(0.2, "Medusa-2: lambda_0 in LM loss + lambda_0 * heads loss")
    kl: bool = setting(False, "Medusa-2: KL to the original model instead of LM loss (self-distilled data)")
    heads_warmup_steps: int = setting(0, "Medusa-2: steps that train only the heads before the joint phase")
    feature_noise: float = setting(0.2, "EAGLE draft: width of the uniform noise on its input features")
    draft_depths: int = setting(1, "EAGLE draft: passes per batch, each over the previous pass's guesses (EAGLE-3's "
                                   "training-time test); depth k's loss weighs decay**k")
    lora_r: int = setting(16, "Medusa-2: LoRA rank")
    lora_alpha: int = setting(32, "Medusa-2: LoRA alpha")
    merge: bool = setting(False, "Medusa-2: save a merged model instead of the LoRA adapter")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {DRAFTS}, got {self.draft!r}")
        if self.draft_depths < 1:
            raise ValueError(f"draft_depths must be >= 1, got {self.draft_depths}")
        if self.draft == "eagle" and self.mode != "medusa1":
            raise ValueError("an EAGLE-style draft trains on a frozen backbone: use mode 'medusa1'")
        if self.epochs < 1 or self.batch_size < 1 or self.max_length < 8:
            raise ValueError("epochs and batch_size must be >= 1 and max_length >= 8")
        self.next_token = self.next_token or self.chained


def prepare_examples(model, data: str | Path, config: TrainConfig) -> tuple[list[Example], list[Example], int]:
    """Tokenised train and held-out examples (deterministic split) and the skipped-record count."""
    conversations, skipped = read_conversations(data, skip_bad=config.skip_bad)
    tokenizer = model.require_tokenizer()
    examples = [tokenize(tokenizer, c, config.max_length) for c in conversations]
    examples = [e for e in examples if any(label != IGNORE for label in e.labels[2:])]
    if not examples:
        raise ValueError(f"{data}: no conversation has assistant tokens within max_length={config.max_length}")
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(config.seed)).tolist()
    held = min(len(examples) - 1, max(1, round(len(examples) * config.eval_fraction))) if len(examples) > 1 else 0
    return [examples[i] for i in order[held:]], [examples[i] for i in order[:held]], skipped


def most_frequent_tokens(examples: list[Example], count: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `count` most frequent assistant tokens (ties: lower id first), sorted, and the share they cover."""
    labels = torch.tensor([t for e in examples for t in e.labels if t != IGNORE], dtype=torch.long)
    frequency = torch.bincount(labels, minlength=vocab_size)
    chosen = torch.sort(-frequency, stable=True).indices[:count].sort().values
    return chosen, float(frequency[chosen].sum()) / max(1, labels.numel())


class HiddenCache:
    """The frozen backbone's last hidden states, in float16 safetensors parts on disk.

    Each state is stored under a hash of its conversation's tokens, so more data, a new split or
    a reordering reuses every state already computed; only conversations not yet seen are run.
    A part is named after the hash of its keys: processes never write the same file.
    """

    PART = 256  # conversations per file

    def __init__(self, directory: Path, model, accelerator: Accelerator):
        self.directory = directory
        meta = directory / "meta.json"
        if accelerator.is_main_process:
            if meta.exists() and json.loads(meta.read_text()) != {"base": model.base_name}:
                for part in directory.glob("part-*.safetensors"):
                    part.unlink()  # made by another model (or an older layout): start over
            directory.mkdir(parents=True, exist_ok=True)
            meta.write_text(json.dumps({"base": model.base_name}))
        accelerator.wait_for_everyone()

    @staticmethod
    def key(example: Example) -> str:
        return hashlib.sha256(torch.tensor(example.input_ids, dtype=torch.int32).numpy().tobytes()).hexdigest()[:32]

    def _stored_keys(self) -> set[str]:
        keys: set[str] = set()
        for part in self.directory.glob("part-*.safetensors"):
            with safe_open(part, "pt") as f:
                keys.update(f.keys())
        return keys

    def states(self, model, examples: list[Example], accelerator: Accelerator) -> list[torch.Tensor]:
        """One (T, hidden) float16 state per example, computing and storing the missing ones."""
        stored = self._stored_keys()
        accelerator.wait_for_everyone()  # every process has listed the parts before any is written
        wanted = [self.key(e) for e in examples]
        missing = {}
        for k, e in zip(wanted, examples, strict=True):
            if k not in stored:
                missing.setdefault(k, e)
        keys = list(missing)
        chunks = [keys[i : i + self.PART] for i in range(0, len(keys), self.PART)]
        mine = chunks[accelerator.process_index :: accelerator.num_processes]
        body = adapter.decoder(model.base_model)
        bar = tqdm(total=sum(map(len, mine)), desc="caching hidden states",
                   disable=not accelerator.is_local_main_process)
        for chunk in mine:
            states = {}
            with torch.inference_mode():
                for k in chunk:
                    ids = torch.tensor([missing[k].input_ids], device=model.device)
                    states[k] = body(input_ids=ids).last_hidden_state[0].to("cpu", torch.float16)
                    bar.update(1)
            path = self.directory / f"part-{hashlib.sha256(''.join(chunk).encode()).hexdigest()[:16]}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file(states, tmp)
            tmp.rename(path)  # a part is either complete or absent
        bar.close()
        accelerator.wait_for_everyone()
        needed = set(wanted)
        found: dict[str, torch.Tensor] = {}
        for part in self.directory.glob("part-*.safetensors"):
            with safe_open(part, "pt") as f:
                found.update((k, f.get_tensor(k)) for k in f.keys() if k in needed)
        return [found[k] for k in wanted]


def batches_for_epoch(count: int, epoch: int, config: TrainConfig, accelerator: Accelerator) -> list[list[int]]:
    """This process's batches of example indices: the epoch's shuffled order, sharded, equal counts."""
    processes = accelerator.num_processes
    if config.batch_size % processes or count < config.batch_size:
        raise ValueError(f"batch size {config.batch_size} must be a multiple of the {processes} process(es) and at "
                         f"most the {count} training conversations")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch)).tolist()
    per_process = config.batch_size // processes
    shard = order[accelerator.process_index :: processes]
    steps = count // config.batch_size
    return [shard[i * per_process : (i + 1) * per_process] for i in range(steps)]


def collate(examples: list[Example], device, states: list[torch.Tensor] | None = None):
    """Pad to the longest: (ids (B, T), labels (B, T), attention mask (B, T), cached hidden or None)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    hidden = None if states is None else torch.zeros(len(examples), width, states[0].shape[-1])
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(e.input_ids), torch.tensor(e.labels), 1
        if states is not None:
            hidden[i, :n] = states[i].float()
    moved = [t.to(device) for t in (ids, labels, mask)]
    return (*moved, None if hidden is None else hidden.to(device))


class TrainModule(torch.nn.Module):
    """Backbone + heads as one module, so that a DDP wrapper sees every trained parameter's forward."""

    def __init__(self, base, heads, config: TrainConfig):
        super().__init__()
        self.base, self.heads, self.config = base, heads, config

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        """Only what training changes (heads, adapters): checkpoints stay small; the frozen
        backbone comes from the base model on resume."""
        state = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        trainable = {prefix + name for name, p in self.named_parameters() if p.requires_grad}
        for key in [k for k in state if k.startswith(prefix) and k not in trainable]:
            del state[key]
        return state

    def draft_loss(self, hidden, ids, labels, noise: float = 0.0, depths: int | None = None):
        """(loss, per-head stats) of the draft (Medusa heads or an EAGLE-style draft) over backbone states; an
        EAGLE draft's stats per depth (`depths` of them: default, the trained ones)."""
        if self.config.draft == "eagle":
            return eagle_loss(self.heads, hidden, ids, labels, noise, depths or self.config.draft_depths,
                              self.config.decay)
        return heads_loss(self.heads, hidden, labels, self.config.decay, ids=ids)

    def forward(self, ids, labels, mask, hidden=None, joint: bool = True):
        """(loss, per-head stats) for one batch; `hidden` holds cached backbone states (Medusa-1)."""
        config = self.config
        if config.mode == "medusa1":
            if hidden is None:
                with torch.no_grad():
                    hidden = adapter.decoder(self.base)(input_ids=ids, attention_mask=mask).last_hidden_state
            return self.draft_loss(hidden.float(), ids, labels, config.feature_noise)
        out = self.base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        h_loss, stats = heads_loss(self.heads, (hidden if joint else hidden.detach()).float(), labels, config.decay,
                                     ids=ids)
        if not joint:
            return h_loss, stats
        if config.kl:
            with torch.no_grad(), self.base.disable_adapter():
                original = self.base(input_ids=ids, attention_mask=mask).logits
            backbone = distill_kl(out.logits, original, labels)
        else:
            backbone = lm_loss(out.logits, labels)
        return backbone + config.head_loss_weight * h_loss, stats


class Trainer:
    """Trains `model.heads` (and, for Medusa-2, LoRA adapters on `model.base_model`)."""

    def __init__(self, model: MedusaModel, config: TrainConfig, out: str | Path,
                 accelerator: Accelerator | None = None):
        self.model, self.config, self.out = model, config, Path(out)
        if accelerator is None:
            from accelerate.utils import DistributedDataParallelKwargs

            # Medusa-2's heads-only warm-up leaves the adapters without gradients for a while
            unused = DistributedDataParallelKwargs(find_unused_parameters=config.mode == "medusa2")
            # cpu=True is what lets accelerate run several CPU processes (gloo) under torchrun
            accelerator = Accelerator(cpu=model.device.type == "cpu", kwargs_handlers=[unused])
        self.accelerator = accelerator
        self.checkpoint_dir = self.out / "checkpoint"
        torch.manual_seed(config.seed)
        base = model.base_model
        for p in base.parameters():
            p.requires_grad_(False)
        if config.mode == "medusa2":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                              target_modules="all-linear")
            base = get_peft_model(base, lora)
        model.heads.float()  # heads train in fp32 whatever the base dtype
        self.module = TrainModule(base, model.heads, config).to(accelerator.device)

    def fit(self, train: list[Example], held_out: list[Example], resume: bool = False) -> dict:
        acc, config = self.accelerator, self.config
        if self.checkpoint_dir.exists() and not resume:
            raise ValueError(f"{self.checkpoint_dir} exists: pass --resume to continue it, or choose another --out")
        if config.draft_vocab:  # fresh heads choose their tokens; heads trained further keep theirs
            heads = self.model.heads.config
            tokens, coverage = most_frequent_tokens(train, heads.draft_vocab, heads.vocab_size)
            self.model.heads.set_token_map(tokens.to(self.model.heads.token_map.device))
            acc.print(f"draft vocabulary: the {heads.draft_vocab} most frequent answer tokens cover {coverage:.2%}")
        states = held_states = None
        if config.mode == "medusa1" and config.cache_hidden:
            folder = Path(config.hidden_cache) if config.hidden_cache else self.out / "hidden-cache"
            cached = HiddenCache(folder, self.model, acc).states(self.model, train + held_out, acc)
            states, held_states = cached[: len(train)], cached[len(train) :]
        steps_per_epoch = len(batches_for_epoch(len(train), 0, config, acc))
        total_steps = steps_per_epoch * config.epochs
        groups = [{"params": [p for p in self.module.heads.parameters() if p.requires_grad],
                   "lr": config.lr * (config.heads_lr_multiplier if config.mode == "medusa2" else 1.0)}]
        if config.mode == "medusa2":
            groups.append({"params": [p for p in self.module.base.parameters() if p.requires_grad], "lr": config.lr})
        optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
        scheduler = get_cosine_schedule_with_warmup(optimizer, round(total_steps * config.warmup_ratio), total_steps)
        module, optimizer, scheduler = acc.prepare(self.module, optimizer, scheduler)
        acc.print(f"{config.mode}: {len(train)} conversations, {steps_per_epoch} steps per epoch on "
                  f"{acc.num_processes} process(es) ({type(module).__name__})")
        position = {"epoch": 0, "step": 0, "global_step": 0}
        if resume and self.checkpoint_dir.exists():
            acc.load_state(str(self.checkpoint_dir), strict=False)  # the checkpoint holds the trained part only
            position = json.loads((self.checkpoint_dir / "position.json").read_text())
            acc.print(f"resuming at epoch {position['epoch'] + 1}, step {position['step']}")
        history_file = self.out / "history.json"
        history = json.loads(history_file.read_text()) if resume and history_file.exists() else []
        for epoch in range(position["epoch"], config.epochs):
            batches = batches_for_epoch(len(train), epoch, config, acc)
            bar = tqdm(total=len(batches), initial=position["step"], desc=f"epoch {epoch + 1}/{config.epochs}",
                       disable=not acc.is_local_main_process)
            started, tokens = time.perf_counter(), 0
            for step in range(position["step"], len(batches)):
                batch = [train[i] for i in batches[step]]
                cached = [states[i] for i in batches[step]] if states is not None else None
                joint = position["global_step"] >= config.heads_warmup_steps
                with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=config.bf16):
                    loss, stats = module(*collate(batch, acc.device, cached), joint=joint)
                acc.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                tokens += sum(len(e.input_ids) for e in batch)
                position = {"epoch": epoch, "step": step + 1, "global_step": position["global_step"] + 1}
                bar.update(1)
                top1 = stats[0, 0].item() / max(1, stats[0, 2].item())
                bar.set_postfix(loss=f"{loss.item():.3f}", head1_top1=f"{top1:.2f}",
                                tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
                if position["global_step"] % config.checkpoint_every == 0:
                    self._checkpoint(position, history)
            bar.close()
            accuracy = self.evaluate(held_out, held_states)
            history.append({"epoch": epoch + 1, "seconds": time.perf_counter() - started, "train_tokens": tokens,
                            "accuracy": accuracy})
            acc.print(f"epoch {epoch + 1}: held-out top-1 / top-5 per head: "
                      + ", ".join(f"{a['top1']:.3f}/{a['top5']:.3f}" for a in accuracy))
            position = {"epoch": epoch + 1, "step": 0, "global_step": position["global_step"]}
            self._checkpoint(position, history)
        self._save(history)
        return {"history": history}

    @torch.no_grad()
    def evaluate(self, examples: list[Example], states: list[torch.Tensor] | None = None) -> list[dict]:
        """Per-head top-1 / top-5 accuracy on held-out examples (from their cached hidden states, if given); an
        EAGLE draft's per depth: its guess of the token d + 1 places ahead, along the real path."""
        totals = 0
        body = adapter.decoder(self.model.base_model)
        for start in range(0, len(examples), 8):
            chunk = slice(start, start + 8)
            ids, labels, mask, hidden = collate(examples[chunk], self.accelerator.device,
                                                None if states is None else states[chunk])
            if hidden is None:
                hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state
            totals = totals + self.module.draft_loss(hidden.float(), ids, labels, depths=EAGLE_EVAL_DEPTHS)[1]
        return [{"top1": t[0].item() / max(1, t[2].item()), "top5": t[1].item() / max(1, t[2].item()),
                 "targets": t[2].item()} for t in totals]

    def _checkpoint(self, position: dict, history: list) -> None:
        acc = self.accelerator
        acc.save_state(str(self.checkpoint_dir))
        if acc.is_main_process:
            (self.checkpoint_dir / "position.json").write_text(json.dumps(position))
            (self.out / "history.json").write_text(json.dumps(history, indent=1))
        acc.wait_for_everyone()

    def _save(self, history: list) -> None:
        """The native heads folder (+ the LoRA adapter or merged backbone for Medusa-2)."""
        acc = self.accelerator
        if not acc.is_main_process:
            return
        extra = {"training": asdict(self.config), "history": history}
        if self.config.mode == "medusa2":
            peft_model = self.module.base
            if self.config.merge:
                merged = peft_model.merge_and_unload()
                merged.save_pretrained(self.out / "model")
                self.model.require_tokenizer().save_pretrained(self.out / "model")
                extra["backbone"] = "merged"
            else:
                peft_model.save_pretrained(self.out / "adapter")
                extra["backbone"] = "adapter"
        save_heads(self.model.heads, self.out, base_model=self.model.base_name, **extra)
        (self.out / Record.FILE).unlink(missing_ok=True)  # a replay record of earlier heads: `medusa calibrate` anew

