"""A tiny Qwen2 model and tokenizer built offline, deterministically, for the e2e tests.

The weights are seeded random with a wide init range (0.2) so that greedy output
depends on the prompt; ``--load-format dummy`` is not used because its near-zero
weights make greedy decoding collapse into a short cycle, which would let a broken
KV transfer pass an equality test.

The result is cached under ``<repo>/.cache/e2e-models/<key>/`` where ``key`` hashes
every parameter of the build (and a builder version), so a changed spec rebuilds and
an unchanged one is reused. Building takes a few seconds; the directory is < 1 MB.

Run ``python -m tests.e2e.model [hybrid|mamba2|gdn|mla]`` from the repository root to
build it (or the hybrid Gemma3, Mamba2, Gated DeltaNet or DeepSeek-V3 MLA model) and
print the path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump when the build procedure changes in a way the parameters do not capture.
BUILDER_VERSION = 3

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO_ROOT / ".cache" / "e2e-models"

EOS_TOKEN = "<|endoftext|>"

_WORDS: tuple[str, ...] = tuple(
    """
the a an of to in on for with from by at
as is was are were be been being cache block token layer
head prefill decode transfer engine request prompt model memory device host network
link rail agent ticket lease plan region stride window alpha beta gamma
delta epsilon zeta theta kappa lambda sigma omega red green blue yellow
orange purple black white silver golden river mountain forest ocean desert valley
island city village harbor quick slow bright dark quiet loud small large
ancient modern run walk jump swim read write build break carry follow
remember one two three four five six seven eight nine ten hundred
thousand north south east west morning evening winter summer spring autumn
    """.split()  # noqa: SIM905
)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Every parameter of the build; its hash names the cache directory."""

    num_hidden_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position_embeddings: int = 512
    initializer_range: float = 0.2
    seed: int = 0
    dtype: str = "bfloat16"
    corpus_sentences: int = 2000
    #: "qwen2"; "gemma3": a hybrid Gemma3 text model whose layers alternate
    #: sliding-window attention (``sliding_window`` tokens) and full attention;
    #: "granite_hybrid": a dense GraniteMoeHybrid (no experts) alternating Mamba2 and
    #: attention layers; "qwen3_next": a Qwen3-Next alternating Gated DeltaNet and
    #: attention layers (its vLLM CPU kernels need bfloat16 and 128-element GDN heads;
    #: vLLM refuses a Qwen3-Next without MoE layers, so it has 4 tiny experts);
    #: "deepseek_v3": a dense DeepSeek-V3 with MLA latent KV (:data:`MLA_DIMS`: vLLM
    #: CPU's MLA kernels take only a 512 + 64 latent; no MoE layer).
    arch: str = "qwen2"
    sliding_window: int = 0
    #: "qwen3_next": its Gated DeltaNet layers' key heads and value heads (as many of
    #: each; 2 lets TP2 split them).
    linear_heads: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if self.arch == "qwen2":  # keys of the original builder stay valid
            del fields["arch"], fields["sliding_window"]
        if self.linear_heads == 1:  # as are the models built before the field
            del fields["linear_heads"]
        if self.arch == "deepseek_v3":
            fields["mla"] = MLA_DIMS
        blob = json.dumps({"builder": BUILDER_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


#: The MLA dimensions of the ``deepseek_v3`` build. vLLM 0.32's CPU MLA backend
#: (``v1/attention/backends/mla/cpu_mla.py``) takes one latent cache head of 576
#: elements only (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, its decode kernel's
#: one compiled size); any other sum fails the first forward ("Head dimension N is not
#: supported by MLA", ``MLACommonMetadata.__post_init__``). The no-PE and V head
#: dimensions are free: they take the spec's ``head_dim``.
MLA_DIMS: dict[str, int] = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def _corpus(spec: TinyModelSpec) -> list[str]:
    rng = random.Random(spec.seed)
    sentences = []
    for _ in range(spec.corpus_sentences):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", "!", "?", ","])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        sentences.append(sentence)
    return sentences


def _build_tokenizer(spec: TinyModelSpec, out: Path) -> int:
    """Train a byte-level BPE with exactly ``vocab_size`` entries; return the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer=trainer)
    if tok.get_vocab_size() != spec.vocab_size:
        # Every id the model can emit must decode; a short corpus would leave gaps.
        raise RuntimeError(
            f"tokenizer vocab {tok.get_vocab_size()} != model vocab {spec.vocab_size}; "
            "raise corpus_sentences"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=spec.max_position_embeddings,
    )
    fast.save_pretrained(str(out))
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None
    return int(eos_id)


def _model_and_config(spec: TinyModelSpec, eos_id: int) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    if spec.arch == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            query_pre_attn_scalar=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            initializer_range=spec.initializer_range,
            # Tied embeddings with random weights make greedy output repeat the last
            # prompt token (VLLM_CPU_TESTBED.md): equality would prove nothing.
            tie_word_embeddings=False,
            sliding_window=spec.sliding_window,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(spec.num_hidden_layers)
            ],
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            architectures=["Gemma3ForCausalLM"],
        )
        return Gemma3ForCausalLM, config
    if spec.arch in _STATE_ARCHS:
        return _state_model_and_config(spec, eos_id)
    if spec.arch == "deepseek_v3":
        return _mla_model_and_config(spec, eos_id)
    if spec.arch != "qwen2":
        raise ValueError(
            f"TinyModelSpec.arch={spec.arch!r}: must be 'qwen2', 'gemma3', "
            "'granite_hybrid', 'qwen3_next' or 'deepseek_v3'"
        )
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        architectures=["Qwen2ForCausalLM"],
    )
    return Qwen2ForCausalLM, config


_STATE_ARCHS = ("granite_hybrid", "qwen3_next")


def _state_model_and_config(spec: TinyModelSpec, eos_id: int) -> Any:
    """A hybrid of recurrent-state layers (even) and full attention (odd)."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.initializer_range,
        "tie_word_embeddings": False,  # see gemma3 above
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    layers = range(spec.num_hidden_layers)
    if spec.arch == "granite_hybrid":
        config = transformers.GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba" if i % 2 == 0 else "attention" for i in layers],
            num_local_experts=0,  # dense: the shared MLP only
            shared_intermediate_size=spec.intermediate_size,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            position_embedding_type="rope",
            architectures=["GraniteMoeHybridForCausalLM"],
        )
        return transformers.GraniteMoeHybridForCausalLM, config
    config = transformers.Qwen3NextConfig(
        **common,
        # vLLM sizes the attention block so that one page holds a state slot (here
        # 2304 B of conv + 64 KiB of float32 SSM state): 2 KV heads of 128 give
        # 1 KiB per token, so 128-token blocks, as the Mamba2 model has.
        head_dim=128,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in layers],
        linear_num_key_heads=spec.linear_heads,
        linear_num_value_heads=spec.linear_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        architectures=["Qwen3NextForCausalLM"],
    )
    return transformers.Qwen3NextForCausalLM, config


def _mla_model_and_config(spec: TinyModelSpec, eos_id: int) -> Any:
    """A dense DeepSeek-V3: MLA attention (latent KV, :data:`MLA_DIMS`) in every layer.

    ``first_k_dense_replace`` covers every layer, so no MoE layer is built (vLLM logs
    "No DeepseekV2MoE layer found"); ``q_lora_rank=None`` gives a plain ``q_proj``.
    """
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,  # MLA: one latent for all heads
        q_lora_rank=None,
        qk_nope_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        kv_lora_rank=MLA_DIMS["kv_lora_rank"],
        qk_rope_head_dim=MLA_DIMS["qk_rope_head_dim"],
        first_k_dense_replace=spec.num_hidden_layers,
        n_routed_experts=4,  # never built (see above); DeepseekV3Config wants a count
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_group=1,
        topk_group=1,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,  # see gemma3 above
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        architectures=["DeepseekV3ForCausalLM"],
    )
    return transformers.DeepseekV3ForCausalLM, config


def _build_model(spec: TinyModelSpec, out: Path, eos_id: int) -> None:
    import torch

    model_cls, config = _model_and_config(spec, eos_id)
    torch.manual_seed(spec.seed)
    model = model_cls(config)
    # Re-draw every parameter from one seeded generator so the weights do not depend
    # on transformers' init order or on which modules it chooses to initialise.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                # Qwen3-Next's gated norm of the Gated DeltaNet output scales by the
                # weight itself (zero would silence every GDN layer and its state).
                param.fill_(1.0)
            elif name.endswith("norm.weight"):
                # Gemma's (and Qwen3-Next's other) RMSNorm scales by (1 + weight):
                # zero is its identity.
                param.fill_(0.0 if spec.arch in ("gemma3", "qwen3_next") else 1.0)
            elif name.endswith(("A_log", "dt_bias", ".D")):
                pass  # the state decay parameters keep their stable defaults
            else:  # projections, embeddings, lm_head and the q/k/v biases
                param.normal_(0.0, spec.initializer_range, generator=gen)
    model = model.to(getattr(torch, spec.dtype))
    model.config.dtype = spec.dtype
    model.save_pretrained(str(out))


def build_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny model for ``spec``, building it if needed.

    The build happens in a temporary sibling directory that is renamed into place,
    so concurrent builders and interrupted builds never leave a half-written model.
    """
    spec = spec or TinyModelSpec()
    cache_dir = Path(cache_dir or os.environ.get("KVXFER_E2E_CACHE", DEFAULT_CACHE))
    target = cache_dir / f"{spec.arch}-tiny-{spec.key()}"
    if (target / ".complete").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        eos_id = _build_tokenizer(spec, tmp)
        _build_model(spec, tmp, eos_id)
        (tmp / "kvxfer_spec.json").write_text(
            json.dumps({"builder": BUILDER_VERSION, **dataclasses.asdict(spec)}, indent=1)
        )
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


#: The hybrid model of tests/e2e/test_pd_hybrid.py: 4 layers alternating a 16-token
#: sliding window and full attention, 2 KV heads of 32. vLLM's hybrid KV cache manager
#: gives it two KV cache groups; a 32-token block holds two window granules, so
#: swa_window_mode cuts blocks.
HYBRID_SPEC = TinyModelSpec(arch="gemma3", num_hidden_layers=4, sliding_window=16)

#: The state hybrids of tests/e2e/test_pd_state.py: 4 layers, Mamba2 (or Gated
#: DeltaNet) at layers 0 and 2, full attention (2 KV heads of 32) at 1 and 3.
MAMBA2_SPEC = TinyModelSpec(arch="granite_hybrid", num_hidden_layers=4, dtype="float32")
GDN_SPEC = TinyModelSpec(arch="qwen3_next", num_hidden_layers=4, dtype="bfloat16")
#: The GDN hybrid with 2 key and 2 value heads per GDN layer, which TP2 splits
#: (tests/e2e/test_pd_state_tp_gdn.py).
GDN_TP_SPEC = dataclasses.replace(GDN_SPEC, linear_heads=2)

#: The MLA model of tests/e2e/test_pd_mla.py: 2 dense DeepSeek-V3 layers, 4 heads of
#: 32 (no-PE part and V), one 576-element latent per token and layer, float32.
MLA_SPEC = TinyModelSpec(arch="deepseek_v3", dtype="float32")


def describe(path: Path) -> dict[str, Any]:
    """Sizes and ids worth logging from a built model directory."""
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    config = json.loads((path / "config.json").read_text())
    return {"path": str(path), "files": files, "eos_token_id": config.get("eos_token_id")}


if __name__ == "__main__":
    import sys

    named = {"hybrid": HYBRID_SPEC, "mamba2": MAMBA2_SPEC, "gdn": GDN_SPEC, "mla": MLA_SPEC}
    spec = named[sys.argv[1]] if sys.argv[1:] else TinyModelSpec()
    print(json.dumps(describe(build_tiny_model(spec)), indent=1))
