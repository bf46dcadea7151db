"""Built-in analytic model profiles: parameter counts against published figures and hand
counts, FLOPs against published MACs and the Megatron formula, scaling, errors, torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepcee.errors import ProfileError
from deepcee.models import get_model, model_names
from deepcee.profile import profile_from_dict

# name -> (published count, precision of the published figure, source). A figure rounded to
# `unit` pins the true count only to within unit / 2, so that is the tolerance; torchvision
# publishes exact counts (unit 1). Like for like: GPT-2 and BERT tie the LM-head / MLM-decoder
# weight to the word embeddings and the published figures count it once, as get_model does
# (in "embed"); the BERT figures are of the pre-training model (encoder + pooler + MLM head
# with decoder bias + NSP classifier), which is what get_model builds.
PUBLISHED = {
    # OpenAI gpt-2 release names its checkpoints by corrected parameter count
    # (download_model.sh: 124M | 355M | 774M | 1558M); HF model cards agree.
    "gpt2": (124_000_000, 1_000_000, "OpenAI gpt-2 '124M'"),
    "gpt2-medium": (355_000_000, 1_000_000, "OpenAI gpt-2 '355M'"),
    "gpt2-xl": (1_558_000_000, 1_000_000, "OpenAI gpt-2 '1558M'"),
    "bert-small": (29_100_000, 100_000, "Turc et al. 2019, BERT-Small 29.1M"),
    "bert-base": (110_000_000, 1_000_000, "Devlin et al. 2019, BERT-BASE 110M"),
    "llama-7b": (6_700_000_000, 100_000_000, "Touvron et al. 2023, Table 2, 6.7B"),
    "llama-1b": (1_100_000_000, 100_000_000, "Zhang et al. 2024, TinyLlama 1.1B"),
    "resnet50": (25_557_032, 1, "torchvision ResNet50_Weights num_params"),
    "resnet101": (44_549_160, 1, "torchvision ResNet101_Weights num_params"),
    "efficientnet-b0": (5_288_548, 1, "torchvision EfficientNet_B0_Weights num_params"),
}


def _forward(model) -> float:
    return sum(layer.forward_flops for layer in model.layers)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    count, unit, _source = PUBLISHED[name]
    model = get_model(name)
    assert abs(model.parameter_count - count) <= unit / 2, (name, model.parameter_count, count)
    assert model.hyper["published_parameter_count"] == count
    assert model.hyper["published_parameter_count_source"]


def test_names_cover_the_spec():
    names = set(model_names())
    assert {
        "gpt2",
        "gpt2-medium",
        "gpt2-xl",
        "bert-small",
        "bert-base",
        "llama",
        "llama-7b",
        "resnet50",
        "resnet101",
        "efficientnet-b0",
        "resnet50-cifar",
        "resnet101-cifar",
        "efficientnet-b0-cifar",
        "gpt-tiny",
        "resnet-tiny",
    } <= names
    for name in names:
        assert get_model(name).parameter_count > 0


def test_gpt_tiny_matches_hand_count():
    # embed: token Embedding(256, 64) + position Embedding(64, 64)
    embed = 256 * 64 + 64 * 64
    # block: LayerNorm(64) x2 (weight + bias), qkv Linear(64, 192), proj Linear(64, 64),
    # fc1 Linear(64, 256), fc2 Linear(256, 64), all with bias
    block = 2 * (64 + 64) + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    # head: final LayerNorm(64) + untied Linear(64, 256) with bias
    head = (64 + 64) + (64 * 256 + 256)
    model = get_model("gpt-tiny")
    assert [la.name for la in model.layers] == [
        "embed",
        "block0",
        "block1",
        "block2",
        "block3",
        "head",
    ]
    assert [la.parameter_count for la in model.layers] == [embed] + [block] * 4 + [head]
    assert model.parameter_count == 237_184
    assert model.dtype == "fp32" and model.input_bytes == 64 * 8
    assert model.hyper["seq_len"] == 64


def test_resnet_tiny_matches_hand_count():
    def gn(c):  # GroupNorm(4, c): weight + bias
        return 2 * c

    def conv(cin, cout, k):  # no bias
        return cin * cout * k * k

    stem = conv(3, 16, 3) + gn(16)
    same16 = 2 * conv(16, 16, 3) + 2 * gn(16)
    down32 = conv(16, 32, 3) + conv(32, 32, 3) + 2 * gn(32) + conv(16, 32, 1) + gn(32)
    same32 = 2 * conv(32, 32, 3) + 2 * gn(32)
    down64 = conv(32, 64, 3) + conv(64, 64, 3) + 2 * gn(64) + conv(32, 64, 1) + gn(64)
    same64 = 2 * conv(64, 64, 3) + 2 * gn(64)
    head = 64 * 10 + 10
    model = get_model("resnet-tiny")
    assert [la.name for la in model.layers] == ["stem"] + [f"block{i}" for i in range(6)] + ["head"]
    assert [la.parameter_count for la in model.layers] == [
        stem,
        same16,
        same16,
        down32,
        same32,
        down64,
        same64,
        head,
    ]
    assert model.parameter_count == 175_258
    assert model.dtype == "fp32" and model.input_bytes == 4 * 3 * 32 * 32
    # Per-sample output maps: 16x32x32 after stem, 64x8x8 after block5, 10 logits.
    assert model.layers[0].output_bytes == 4 * 16 * 32 * 32
    assert model.layers[6].output_bytes == 4 * 64 * 8 * 8
    assert model.layers[7].output_bytes == 4 * 10


def test_gpt2_forward_flops_close_to_2_params_tokens_plus_attention():
    model = get_model("gpt2")
    s, h, n_layers = 1024, 768, 12
    expected = 2 * model.parameter_count * s + 4 * s * s * h * n_layers
    assert abs(_forward(model) / expected - 1) < 0.10


def test_gpt2_block_flops_and_activations_follow_megatron_and_korthikanti():
    h, a = 768, 12
    for s in (128, 1024):
        block = get_model("gpt2", seq_len=s).layers[1]
        assert block.forward_flops == 24 * s * h * h + 4 * s * s * h
        # Narayanan et al. 2021: forward + backward = 72 s h^2 + 12 s^2 h per block.
        assert block.forward_flops + block.input_grad_flops + block.weight_grad_flops == (
            72 * s * h * h + 12 * s * s * h
        )
        assert block.weight_grad_flops == 24 * s * h * h  # attention matmuls have no weights
        assert block.activation_bytes == s * h * (34 + 5 * a * s / h)  # Korthikanti et al.


@pytest.mark.parametrize(
    "name,published_gmacs,tolerance",
    [
        ("resnet50", 4.09, 0.10),  # torchvision docs: GFLOPS (multiply-adds) 4.09
        ("resnet101", 7.80, 0.10),  # torchvision docs: 7.80
        ("efficientnet-b0", 0.39, 0.15),  # torchvision docs: 0.39
    ],
)
def test_cnn_forward_macs_match_published(name, published_gmacs, tolerance):
    gmacs = _forward(get_model(name)) / 2 / 1e9
    assert abs(gmacs / published_gmacs - 1) < tolerance, gmacs


def test_seq_len_scales_flops_and_activations():
    short, long = get_model("gpt2", seq_len=256), get_model("gpt2", seq_len=512)
    for a, b in zip(short.layers, long.layers, strict=True):
        if a.name in ("embed", "head"):  # per-token layers: exactly linear
            assert b.forward_flops == pytest.approx(2 * a.forward_flops)
            assert b.activation_bytes == pytest.approx(2 * a.activation_bytes)
        else:  # linear part plus the quadratic attention part: between 2x and 4x
            assert 2 * a.forward_flops < b.forward_flops < 4 * a.forward_flops
            assert 2 * a.activation_bytes < b.activation_bytes < 4 * a.activation_bytes
        assert b.output_bytes == pytest.approx(2 * a.output_bytes)
    assert long.input_bytes == 2 * short.input_bytes == 512 * 8


def test_image_size_scales_flops_and_activations():
    small, large = get_model("resnet50"), get_model("resnet50", image_size=448)
    # Every conv map doubles in both sides; only the classifier stays the same.
    assert _forward(large) / _forward(small) == pytest.approx(4, rel=1e-3)
    total = small.num_layers
    assert large.activation_bytes(0, total) / small.activation_bytes(0, total) == pytest.approx(
        4, rel=1e-3
    )
    assert large.input_bytes == 4 * small.input_bytes == 4 * 2 * 3 * 224 * 224


@pytest.mark.parametrize(
    "name,features", [("resnet50", 2048), ("resnet101", 2048), ("efficientnet-b0", 1280)]
)
def test_cifar_variants_differ_only_in_the_classifier(name, features):
    full, cifar = get_model(name), get_model(f"{name}-cifar")
    assert cifar.hyper["image_size"] == 32 and cifar.hyper["num_classes"] == 10
    # Linear(features, 1000) vs Linear(features, 10), both with bias.
    assert full.parameter_count - cifar.parameter_count == (1000 - 10) * (features + 1)
    assert [la.parameter_count for la in full.layers[:-1]] == [
        la.parameter_count for la in cifar.layers[:-1]
    ]


def test_gradient_flop_rules():
    gpt = get_model("gpt2")
    assert gpt.layers[0].input_grad_flops == gpt.layers[0].forward_flops == 0
    head = gpt.layers[-1]
    assert head.input_grad_flops == head.weight_grad_flops == head.forward_flops > 0
    resnet = get_model("resnet50")
    stem = resnet.layers[0]
    # The stem is one conv reading the image: it needs no input gradient.
    assert stem.input_grad_flops == 0 and stem.weight_grad_flops == stem.forward_flops > 0
    for layer in resnet.layers[1:]:
        assert layer.input_grad_flops == layer.weight_grad_flops == layer.forward_flops > 0


def test_tied_heads_count_the_matrix_once_untied_heads_hold_it():
    gpt = get_model("gpt2")
    assert gpt.layers[-1].parameter_count == 2 * 768  # final LayerNorm only
    assert gpt.layers[0].parameter_count == (50257 + 1024) * 768
    llama = get_model("llama-7b")
    assert llama.layers[-1].parameter_count == 4096 + 4096 * 32000  # RMSNorm + untied head
    assert llama.layers[0].parameter_count == 32000 * 4096


def test_llama_overrides_change_the_shape():
    h, n_layers, f, v = 512, 2, 1376, 1000
    model = get_model(
        "llama",
        hidden_size=h,
        num_layers=n_layers,
        num_heads=8,
        ffn_size=f,
        vocab_size=v,
        seq_len=256,
    )
    block = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm weights
    assert model.parameter_count == v * h + n_layers * block + h + h * v
    assert model.num_layers == n_layers + 2
    assert model.hyper["published_parameter_count"] is None
    gqa = get_model(
        "llama", hidden_size=h, num_layers=1, num_heads=8, num_kv_heads=2, ffn_size=f, vocab_size=v
    )
    assert gqa.layers[1].parameter_count == 2 * h * h + 2 * h * (h // 4) + 3 * h * f + 2 * h


@pytest.mark.parametrize(
    "dtype,optimizer,grad,state",
    [
        ("fp16", "adam", 2, 16),
        ("bf16", "adam", 2, 16),
        ("fp32", "adam", 4, 16),
        ("fp16", "sgd", 2, 12),
        ("fp32", "sgd", 4, 12),
    ],
)
def test_dtype_and_optimizer_bytes(dtype, optimizer, grad, state):
    model = get_model("bert-small", dtype=dtype, optimizer=optimizer)
    assert model.gradient_bytes_per_parameter == grad
    assert model.state_bytes_per_parameter == state
    assert (model.dtype, model.optimizer) == (dtype, optimizer)


def test_fp32_doubles_tensors_but_not_dropout_masks():
    half, full = get_model("gpt2", seq_len=128), get_model("gpt2", seq_len=128, dtype="fp32")
    s, h, a = 128, 768, 12
    masks = a * s * s + 2 * s * h  # 1-byte dropout masks per block
    assert full.layers[1].activation_bytes == 2 * (half.layers[1].activation_bytes - masks) + masks
    assert full.layers[1].output_bytes == 2 * half.layers[1].output_bytes
    cnn16, cnn32 = get_model("resnet-tiny", dtype="fp16"), get_model("resnet-tiny")
    assert _forward(cnn16) == _forward(cnn32)
    assert cnn32.activation_bytes(0, 8) == 2 * cnn16.activation_bytes(0, 8)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda: get_model("gpt5"), "'gpt5'"),
        (lambda: get_model("gpt2", seq_len=-5), "-5"),
        (lambda: get_model("gpt2", seq_len=0), "seq_len"),
        (lambda: get_model("gpt2", seq_len=2048), "2048"),
        (lambda: get_model("bert-base", seq_len=1.5), "1.5"),
        (lambda: get_model("resnet50", image_size=-1), "-1"),
        (lambda: get_model("resnet50", image_size=0), "image_size"),
        (lambda: get_model("resnet50", seq_len=128), "seq_len=128"),
        (lambda: get_model("gpt2", image_size=224), "image_size=224"),
        (lambda: get_model("gpt2", dtype="int8"), "'int8'"),
        (lambda: get_model("gpt2", optimizer="lamb"), "'lamb'"),
        (lambda: get_model("gpt2", hidden_size=512), "gpt2"),
        (lambda: get_model("llama", hidden_dim=512), "hidden_dim"),
        (lambda: get_model("llama", hidden_size=500, num_heads=32), "500"),
        (lambda: get_model("llama", num_layers=-2), "-2"),
    ],
)
def test_bad_values_raise_profile_error_naming_them(call, needle):
    with pytest.raises(ProfileError) as info:
        call()
    assert needle in str(info.value)


def test_unknown_name_lists_known_names():
    with pytest.raises(ProfileError) as info:
        get_model("resnet9000")
    assert "resnet50" in str(info.value) and "gpt-tiny" in str(info.value)


def test_profiles_round_trip_through_json():
    for name in model_names():
        model = get_model(name)
        again = profile_from_dict(json.loads(json.dumps(model.to_dict())))
        assert again.layers == model.layers and dict(again.hyper) == dict(model.hyper)


def test_models_do_not_import_torch():
    code = (
        "import sys; from deepcee.models import get_model, model_names; "
        "[get_model(n) for n in model_names()]; "
        "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
