"""Login-node checks of the config against the target itself: its depth, width and vocab
(whether the teacher can reproduce its logits is the model's check: hpc/model/model_checks.py).

Adapting a recipe to another target used to take a `validate` per mismatch, each check
waiting for the one before it. Here every check compares against the target's own numbers,
so one run names every mismatch, and a last line gives the overrides that fix them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc.config.checker import Checker
from hpc.config.schema import DSparkConfig
from hpc.config.target import cached_config_dir, read_config_json
from hpc.errors import UserError

CONFIGURED = "verifier.*"  # the shape's source when the target's config.json is not on this machine


@dataclass
class TargetShape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    source: str  # where the numbers came from, for messages
    architectures: tuple[str, ...] = ()  # the target's model classes, when its config.json was read
    text_config: dict = field(default_factory=dict)  # the language model's config.json, when read

    @property
    def read(self) -> bool:
        return self.source != CONFIGURED


def target_shape(cfg: DSparkConfig) -> TargetShape:
    """The target's real dims from its config.json when it is local (a directory or the HF
    cache: never the network, login nodes often have none), else the configured ones."""
    v = cfg.verifier
    where = cached_config_dir(v.model, v.revision)
    config_json = where / "config.json" if where is not None else None
    if config_json is not None and config_json.is_file():
        outer = read_config_json(config_json, v.model)
        data = outer.get("text_config") or outer  # multimodal wrappers keep the LM dims nested
        return TargetShape(
            data.get("num_hidden_layers", v.num_hidden_layers),
            data.get("hidden_size", v.hidden_size),
            data.get("vocab_size", v.vocab_size),
            str(config_json),
            tuple(outer.get("architectures") or ()),
            data,
        )
    return TargetShape(v.num_hidden_layers, v.hidden_size, v.vocab_size, CONFIGURED)


def shape_once(c: Checker, cfg: DSparkConfig, shapes: dict | None) -> TargetShape:
    """`target_shape`, read once per target when a sweep validates many variants of one config
    (`shapes` is shared between the calls). An unreadable config.json is one problem among the
    rest, not a crash."""
    v = cfg.verifier
    which = (v.model, v.revision, v.num_hidden_layers, v.hidden_size, v.vocab_size)
    shapes = {} if shapes is None else shapes
    if which not in shapes:
        try:
            shapes[which] = (target_shape(cfg), None)
        except UserError as err:
            shapes[which] = (TargetShape(v.num_hidden_layers, v.hidden_size, v.vocab_size, CONFIGURED), str(err))
    shape, problem = shapes[which]
    if problem:
        c.problems.append(problem)
    return shape


def _heads_fix(hidden: int, head_dim: int, kv_heads: int) -> dict[str, int]:
    """Attention dims whose heads x head_dim is `hidden`: the configured head_dim kept when it
    divides it (kv heads too, when they still divide the heads), else 128 or 64."""
    for hd in (head_dim, 128, 64, 32):
        if hd > 0 and hd % 2 == 0 and hidden % hd == 0:
            heads = hidden // hd
            fix = {"draft.num_attention_heads": heads}
            if hd != head_dim:
                fix["draft.head_dim"] = hd
            if kv_heads <= 0 or heads % kv_heads:
                fix["draft.num_key_value_heads"] = max(k for k in (8, 4, 2, 1) if heads % k == 0)
            return fix
    return {}


def check_target(c: Checker, cfg: DSparkConfig, shape: TargetShape) -> None:
    v, d = cfg.verifier, cfg.draft
    fixes: dict[str, int] = {}
    where = f"per {shape.source}"
    ids = list(v.aux_layer_ids)
    past = [i for i in ids if not 0 <= i <= shape.num_hidden_layers]
    if past:
        c.fail("verifier.aux_layer_ids", ids,
               f"id {past[0]} outside 0..{shape.num_hidden_layers} (the target has {shape.num_hidden_layers} layers "
               f"{where}); pick ids in that range")
    if shape.read:
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            mine, real = getattr(v, key), getattr(shape, key)
            if mine != real:
                fixes[f"verifier.{key}"] = real
                c.fail(f"verifier.{key}", mine, f"the target's config.json says {real}; set verifier.{key}={real}, "
                       "or leave the key out: it follows the target")
    # The draft's width is the target's (it embeds tokens with the target's embed_tokens).
    hidden = shape.hidden_size
    if d.hidden_size != hidden:
        fixes["draft.hidden_size"] = hidden
        c.fail("draft.hidden_size", d.hidden_size,
               f"must equal the target hidden size {hidden} ({where}): the draft embeds tokens with the target's "
               f"embed_tokens; set draft.hidden_size={hidden}, or leave it out: it follows verifier.hidden_size")
    if d.num_attention_heads > 0 and d.head_dim > 0 and d.num_attention_heads * d.head_dim != hidden:
        heads = _heads_fix(hidden, d.head_dim, d.num_key_value_heads)
        fixes.update(heads)
        fix = " ".join(f"{k}={val}" for k, val in heads.items()) or "a head_dim that divides it"
        c.fail("draft.num_attention_heads", d.num_attention_heads,
               f"heads x head_dim = {d.num_attention_heads} x {d.head_dim} = {d.num_attention_heads * d.head_dim} "
               f"!= the target hidden size {hidden}; set {fix}")
    if not 0 <= d.mask_token_id < shape.vocab_size:
        c.fail("draft.mask_token_id", d.mask_token_id,
               f"outside the target vocab 0..{shape.vocab_size - 1}; use a reserved id of the target tokenizer")
    if d.draft_vocab_size > shape.vocab_size:
        fixes["draft.draft_vocab_size"] = shape.vocab_size
        c.fail("draft.draft_vocab_size", d.draft_vocab_size,
               f"larger than the target vocab {shape.vocab_size}; set it <= {shape.vocab_size}")
    if len(fixes) > 1:
        c.problems.append(f"target shape ({shape.source}): these overrides fix every shape mismatch above at once: "
                          + " ".join(f"{k}={val}" for k, val in fixes.items()))
