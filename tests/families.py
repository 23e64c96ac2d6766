"""Tiny random models of every family, built by stock `transformers` (shared by the family tests).

Each exercises what makes its family different: Mistral a window shorter than the test sequences,
Qwen2 q/k/v biases, Qwen3 a head size apart from hidden/heads and q/k norms, Gemma 2 score and logit
soft-capping, Gemma 3 sliding and global layers with their own RoPE bases, a query scale apart from
the head size, sandwich norms and (1 + w) norm weights. Weights are drawn wider than the libraries'
initialization (and norms away from 1) so that logits are far from ties and a mix-up of conventions
shows."""
from __future__ import annotations

import torch

WINDOW = 8  # shorter than the test sequences, so the windowed layers really cut

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=False)


def hf_configs(transformers) -> dict:
    t = transformers
    return {
        "llama": t.LlamaConfig(**BASE, num_hidden_layers=2, rope_theta=10000.0),
        "mistral": t.MistralConfig(**BASE, num_hidden_layers=2, sliding_window=WINDOW, head_dim=24),
        "qwen2": t.Qwen2Config(**{**BASE, "tie_word_embeddings": True}, num_hidden_layers=2),
        "qwen3": t.Qwen3Config(**BASE, num_hidden_layers=2, head_dim=32),
        "gemma2": t.Gemma2Config(**{**BASE, "tie_word_embeddings": True}, num_hidden_layers=2, head_dim=16,
                                 sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                 final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
        "gemma3_text": t.Gemma3TextConfig(**{**BASE, "tie_word_embeddings": True},
                                          num_hidden_layers=6, head_dim=32, sliding_window=WINDOW,
                                          query_pre_attn_scalar=20),
    }


def moe_configs(transformers) -> dict:
    """Mixture-of-experts families: enough experts that a short batch leaves some without a token."""
    t = transformers
    return {
        "mixtral": t.MixtralConfig(**BASE, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
        "qwen3_moe": t.Qwen3MoeConfig(**BASE, num_hidden_layers=3, head_dim=32, num_experts=12, num_experts_per_tok=3,
                                      moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
        "qwen2_moe": t.Qwen2MoeConfig(**BASE, num_hidden_layers=2, num_experts=6, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=96,
                                      norm_topk_prob=False),
    }


def build_hf_model(transformers, family: str, seed: int = 0, changes: dict | None = None):
    cfg = {**hf_configs(transformers), **moe_configs(transformers)}[family]
    for key, value in (changes or {}).items():
        setattr(cfg, key, value)
    # eager attention: the soft-capped families need it (SDPA cannot cap scores)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1 (Gemma: away from 0): a lost (1 + w) offset changes everything
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def save_hf_model(transformers, family: str, out, seed: int = 0):
    model = build_hf_model(transformers, family, seed)
    model.save_pretrained(out, safe_serialization=True)
    return model


# GGUF exports of these models (llama.cpp's parity tests): llama.cpp fixes Gemma's query scale at
# 1/sqrt(head size) and runs `llama` files without a window, so those configs say the same.
GGUF_CHANGES = {"mistral": dict(sliding_window=None), "gemma2": dict(query_pre_attn_scalar=16),
                "gemma3_text": dict(query_pre_attn_scalar=32)}
SPM_FAMILIES = ("mistral", "gemma2", "gemma3_text")  # shipped with SentencePiece-style vocabularies


def build_hf_model_for_gguf(transformers, family: str, seed: int = 0):
    return build_hf_model(transformers, family, seed, GGUF_CHANGES.get(family))


def byte_level_tokenizer(size: int = 320):
    """A byte-level BPE of exactly `size` tokens, trained on Tiny Shakespeare, with a BOS "<s>" and no
    end-of-text token: a random model's generations run to their length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hardy.data.text import resolve_text_path
    from hardy.formats.tokenizer import HardyTokenizer

    text = resolve_text_path("tinyshakespeare").read_text()[:200_000]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<s>"], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(text.split("\n\n"), trainer=trainer)
    assert backend.get_vocab_size() == size, backend.get_vocab_size()
    return HardyTokenizer(backend=backend, bos_id=backend.token_to_id("<s>"), add_bos=False, pre="gpt-2")


SPM_CHARS = "\u2581etoahsnrildumywfcgbpkvITAW,.:;'!?"
# each built from two earlier pieces, as SentencePiece's BPE training builds them
SPM_MERGED = ["th", "he", "\u2581t", "\u2581th", "\u2581the", "in", "er", "an", "\u2581a", "ou", "\u2581s",
              "\u2581w", "\u2581m", "\u2581I", "\u2581h", "ll", "\u2581an", "\u2581and", "\u2581b", "on", "or",
              "en", "is", "it", "\u2581o", "\u2581of"]


def spm_pieces() -> list[str]:
    pieces = list(SPM_CHARS)
    for piece in SPM_MERGED:
        assert any(piece[:i] in pieces and piece[i:] in pieces for i in range(1, len(piece))), piece
        pieces.append(piece)
    return pieces


def sentencepiece_tokenizer(size: int = 320, space_prefix: bool = True):
    """A SentencePiece-style vocabulary of `size` pieces (4 specials, 256 byte tokens, pieces scored by
    their order) as hardy builds one from GGUF metadata."""
    from hardy.formats.tokenizer import HardyTokenizer, sentencepiece_bpe
    from tokenizers import AddedToken

    specials = ["<pad>", "</s>", "<s>", "<unk>"]
    pieces = spm_pieces()
    assert len(specials) + 256 + len(pieces) == size, len(pieces)
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    backend = sentencepiece_bpe(tokens, scores, types, space_prefix, 3)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials[:3]])
    return HardyTokenizer(backend=backend, bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_bos=True,
                          add_space_prefix=space_prefix, scores=scores, types=types)


def llama_cpp_greedy(llm, prompt: list[int], n: int) -> list[int]:
    """The first `n` greedy tokens llama.cpp (llama-cpp-python) continues `prompt` with."""
    out = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out
