"""Toy verifier targets: tiny HF models that vLLM can serve, built offline and deterministically.

The real targets (Kimi-K2.x) need a GPU node; every stage of the pipeline is instead exercised on
CPU against toys that keep the same *interfaces*: an HF directory with safetensors weights, a
byte-level BPE tokenizer with a chat template and a reserved mask token, and either a dense Qwen3
(outputs match HF exactly in vLLM) or a DeepseekV3 (MLA + MoE, Kimi's architecture).

The corpus is chat-shaped prose present on every machine: questions about the Python standard
library answered by its own documentation (toy_corpus.py says what and why). Builds are cached
under a hash of everything that affects the result, so a second call returns at once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from hpc.fsio import replace_dir
from hpc_dev.toy_config import ToyConfig
from hpc_dev.toy_corpus import exchanges, split

# Kimi-style chat markers, so chat-template code written against the toy also fits the real target.
PAD, SYSTEM, USER, ASSISTANT, MIDDLE, END, MASK = (
    "<|endoftext|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|mask|>",
)
SPECIAL_TOKENS = [PAD, SYSTEM, USER, ASSISTANT, MIDDLE, END, MASK]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Versions whose changes alter the built files (tokenizer format, weight layout, numerics).
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
READY = ".toy-ready"


# ---------------------------------------------------------------------------------------------
# Corpus and tokenizer


def chat_texts(tok, pairs) -> list[str]:
    """Each exchange rendered by the chat template, exactly as a served conversation reads."""
    return [tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                    tokenize=False) for q, a in pairs]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (any byte string encodes) with the chat markers and mask token reserved."""
    from transformers import PreTrainedTokenizerFast  # transformers: loaded only on this path

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=END, pad_token=PAD, mask_token=MASK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, MIDDLE], model_max_length=4096,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------
# Models


def make_model(cfg: ToyConfig, tok):
    """A freshly initialised HF model for cfg; the caller seeds torch first."""
    import transformers  # transformers: loaded only on this path

    common = dict(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, dtype="float32",
    )
    if cfg.arch == "qwen3":
        qwen = transformers.Qwen3Config(**common, head_dim=cfg.head_dim)
        return transformers.Qwen3ForCausalLM(qwen)
    # HF's @strict config takes attributes beyond its fields as **kwargs at runtime; its typing does not.
    config = transformers.DeepseekV3Config(  # type: ignore[call-arg]
        **common, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=1, moe_intermediate_size=cfg.moe_intermediate_size,
        first_k_dense_replace=cfg.first_k_dense_replace, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, num_nextn_predict_layers=0,
        # vLLM's DeepseekV3 reads these (Kimi/DeepSeek-V3 routing); HF keeps them as plain attributes.
        topk_method="noaux_tc", scoring_func="sigmoid",
    )
    return transformers.DeepseekV3ForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# Cache and build


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or "~/.cache/dspark").expanduser()


def build_key(cfg: ToyConfig) -> str:
    """A hash of the config, the key packages, the corpus sources and the build's own code:
    cheap to compute (no corpus parsing), so a cache hit returns at once."""
    from hpc_dev import toy_config, toy_corpus, toy_train  # torch: loaded only on this path

    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    for pkg in KEY_PACKAGES:
        h.update(f"{pkg}=={importlib.metadata.version(pkg)}".encode())
    h.update(toy_corpus.fingerprint())
    # sys.modules, not __import__(__name__): that returns the top-level package, hpc_dev.
    for module in (toy_config, toy_train, sys.modules[__name__]):
        assert module.__file__ is not None  # source modules
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


HELD_OUT = "held_out.jsonl"  # the exchanges training never saw: the report's perplexity set


def _build_into(cfg: ToyConfig, pairs: list, out: Path, progress: bool) -> dict:
    import torch  # torch: loaded only on this path

    from hpc_dev.toy_train import greedy_sample, train  # torch: loaded only on this path

    train_pairs, held_out = split(pairs)
    tok = train_tokenizer([f"{q}\n{a}" for q, a in train_pairs], cfg.vocab_size)
    torch.manual_seed(cfg.seed)
    model = make_model(cfg, tok)
    loss = train(model, tok, chat_texts(tok, train_pairs), cfg, progress=progress)
    model.eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What does the json module do?"}],
                                     add_generation_prompt=True, tokenize=False)
    sample = greedy_sample(model, tok, prompt, max_new_tokens=48)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / HELD_OUT).write_text("".join(json.dumps({"user": q, "assistant": a}) + "\n" for q, a in held_out))
    info = {
        "config": dataclasses.asdict(cfg), "final_loss": loss, "greedy_sample": sample,
        "corpus": {"what": "Python stdlib docstrings as user/assistant exchanges (toy_corpus.py)",
                   "train_exchanges": len(train_pairs), "held_out_exchanges": len(held_out)},
        "vocab_size": len(tok), "mask_token_id": tok.mask_token_id,
    }
    (out / "toy_build.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def toy_target_built(arch: str = "qwen3", seed: int = 0, *, config: ToyConfig | None = None,
                     cache_dir: str | Path | None = None) -> bool:
    """Whether `build_toy_target` with these arguments finds its target in the cache (no build)."""
    cfg = config or ToyConfig.preset(arch, seed, None)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return (root / "toy" / f"{cfg.arch}-{build_key(cfg)}" / READY).is_file()


def build_toy_target(
    out_dir: str | Path | None = None,
    arch: str = "qwen3",
    seed: int = 0,
    *,
    steps: int | None = None,
    config: ToyConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> Path:
    """Build (or fetch from the cache) a toy HF target; return its directory.

    With ``out_dir`` the cached directory is copied there and ``out_dir`` is returned;
    otherwise the cache path itself is returned (treat it as read-only).
    """
    cfg = config or ToyConfig.preset(arch, seed, steps)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    entry = root / "toy" / f"{cfg.arch}-{build_key(cfg)}"
    if not (entry / READY).is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Parallel test sessions or jobs build one entry once; the others wait and reuse it.
        with open(entry.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (entry / READY).is_file():
                tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                _build_into(cfg, exchanges(cfg.corpus_limit), tmp, progress)
                (tmp / READY).write_text("")
                replace_dir(tmp, entry)
    if out_dir is None:
        return entry
    out = Path(out_dir)
    shutil.copytree(entry, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(READY))
    return out


def build_info(model_dir: str | Path) -> dict:
    """What a toy build recorded: config, final loss, greedy sample, corpus."""
    return json.loads((Path(model_dir) / "toy_build.json").read_text())
