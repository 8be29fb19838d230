"""How an answer is decoded, defined once: the library's keyword arguments (`generate(..., **settings)`), the
CLI's options (`medusa generate`, `medusa chat`) and the server's request fields all take their defaults and
help from `Decoding`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .acceptance import Sampling
from .settings import setting

TREE_HELP = ("auto (the tree probed fastest on this machine), a preset (default, reference, chain-D, dense-WxD, "
             "plain) or a JSON file; append +lookupL for a prompt-lookup branch of L tokens (+lookup0 drops it); an "
             "EAGLE-style draft grows dynamic-NxDxK trees (N tokens, D rounds of top-K)")


@dataclass
class Decoding(Sampling):
    """The sampling (acceptance, temperature, top_p, epsilon, delta), the tree, how long, what stops it, the seed."""

    max_new_tokens: int = setting(256, "new tokens at most")
    tree: str = setting("auto", TREE_HELP)  # the library also takes a Tree or a list of paths
    stop: list[str] = field(default_factory=list, metadata={"help": "strings that end the answer (cut from the text)"})
    seed: int | None = setting(None, "seed of the sampling (none: a fresh random stream)")
    adapt: bool = setting(False, "the tree follows what each answer accepts (medusa_heads.adaptive; measured no "
                          "faster on a 2-core AMD EPYC)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def sampling(self) -> Sampling:
        return Sampling(**{f.name: getattr(self, f.name) for f in fields(Sampling)})

    def request_settings(self) -> dict:
        """What a `decoder.Request` takes of these settings (the tree and adapt are the Decoder's)."""
        return {"max_new_tokens": self.max_new_tokens, "sampling": self.sampling, "stop": self.stop, "seed": self.seed}
