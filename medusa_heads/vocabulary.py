"""A draft's output vocabulary: the base model's lm_head, borrowed frozen, or a subset of its rows."""

from __future__ import annotations

import torch
from torch import nn

from . import speed


class DraftVocabulary(nn.Module):
    """Base class of drafts that score tokens through the base lm_head (`shared_logits`).

    With a draft vocabulary of `draft_vocab` tokens, only the lm_head rows of `token_map` (a buffer saved
    with the draft) are used: logits index into token_map, and `token_ids` maps them back to token ids.
    """

    def borrow_lm_head(self, lm_head: nn.Linear, draft_vocab: int) -> None:
        # Held outside the module tree: the base model owns it, we only borrow it.
        object.__setattr__(self, "base_lm_head", lm_head)
        draft = torch.arange(draft_vocab) if draft_vocab else None
        self.register_buffer("token_map", draft)  # saved with the draft (None: the full vocabulary)
        self.register_buffer("draft_weight", None if draft is None else lm_head.weight.detach()[draft].clone(),
                             persistent=False)
        if draft is not None:
            self.register_load_state_dict_post_hook(lambda module, _: module.set_token_map(module.token_map))

    def set_token_map(self, token_ids: torch.Tensor) -> None:
        """Choose the draft vocabulary: the token ids the draft may propose (draft_vocab of them)."""
        vocab = self.base_lm_head.weight.shape[0]
        if self.token_map is None or token_ids.shape != self.token_map.shape:
            raise ValueError(f"need {0 if self.token_map is None else len(self.token_map)} token ids for this "
                             "draft vocabulary")
        if token_ids.numel() and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}) for this vocabulary")
        with torch.no_grad():
            self.token_map.copy_(token_ids)
            self.draft_weight.copy_(self.base_lm_head.weight[self.token_map.to(self.base_lm_head.weight.device)])

    def draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Where each token id sits in the draft's logits; -1 for tokens outside the draft vocabulary."""
        if self.token_map is None:
            return token_ids
        lookup = torch.full((self.base_lm_head.weight.shape[0],), -1, dtype=torch.long, device=token_ids.device)
        lookup[self.token_map.to(token_ids.device)] = torch.arange(len(self.token_map), device=token_ids.device)
        return lookup[token_ids]

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in the draft's logits."""
        return indices if self.token_map is None else self.token_map[indices]

    def shared_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias of `shared_logits`: the base lm_head's, or their draft vocabulary's rows."""
        bias = getattr(self.base_lm_head, "bias", None)
        if self.token_map is None:
            return self.base_lm_head.weight, bias
        return self.draft_weight, None if bias is None else bias[self.token_map].to(self.draft_weight.dtype)

    def shared_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits of states over the draft vocabulary (the whole vocabulary without one), by the base lm_head
        (over a draft vocabulary, in a decoding step on a CPU, by `speed.draft_linear`)."""
        if self.token_map is None:
            return self.base_lm_head(states.to(self.base_lm_head.weight.dtype))
        return speed.draft_linear(states.to(self.draft_weight.dtype), *self.shared_projection())
