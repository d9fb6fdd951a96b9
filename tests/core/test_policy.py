"""The tiny policy: built here, loaded back, sampled from a screenshot, trained on alike."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from core.encoding import (
    ImageCache,
    encode_prompt,
    encode_prompt_response,
    prompt_parts,
    to_qwen_messages,
)
from core.generation import NEVER_GENERATED, generate, sequence_logprobs
from core.policy import load_policy, load_weights_into, save_checkpoint
from training.tiny_policy import build_tiny_policy

UI_TARS_RESPONSE = (
    "Thought: The submit button is at the bottom.\n"
    "Action: click(start_box='<|box_start|>(123,45)<|box_end|>')"
)


def screenshot_url(width: int = 160, height: int = 210) -> str:
    """A MiniWoB-sized PNG screenshot with a blue button, as a data URL."""
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).rectangle([20, 150, 100, 180], fill="blue")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def step_messages(instruction: str = "Click the submit button.") -> list[dict]:
    return [
        {"role": "system", "content": "You are a GUI agent."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": instruction},
                {"type": "image_url", "image_url": {"url": screenshot_url()}},
            ],
        },
    ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="module")
def policy(tiny_dir):
    # One thread: on a shared 2-core machine two OpenMP threads spin against other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_policy(tiny_dir)
    torch.set_num_threads(threads)


def test_tiny_policy_is_a_small_qwen3_vl_directory(tiny_dir, policy):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "preprocessor_config.json",
    } <= names
    assert policy.model.config.model_type == "qwen3_vl"
    # The learned absolute position table that lets it ground (docs/benchmarks.md, "Tiny policy grounding").
    assert policy.model.model.visual.pos_embed.weight.shape[0] == 576
    params = sum(p.numel() for p in policy.model.parameters())
    assert 2_000_000 < params < 40_000_000
    tok = policy.tokenizer
    for special in ("<|im_start|>", "<|im_end|>", "<|box_start|>", "<|image_pad|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    # Coordinates tokenize one digit per token, as with the real Qwen tokenizer.
    pieces = tok.convert_ids_to_tokens(tok("(123,45)", add_special_tokens=False)["input_ids"])
    assert pieces == ["(", "1", "2", "3", ",", "4", "5", ")"]


def test_screenshot_sizes_map_to_bounded_image_tokens(policy):
    miniwob = encode_prompt(policy, step_messages())
    assert int(miniwob.mm_token_type_ids.sum()) == 48  # 160x210 -> 168x224 px
    desktop = step_messages()
    desktop[1]["content"][1]["image_url"]["url"] = screenshot_url(1024, 768)
    assert int(encode_prompt(policy, desktop).mm_token_type_ids.sum()) <= 256


@pytest.mark.parametrize("bounds", ["policy", "released"])
def test_pixel_values_equal_the_image_processors_bit_for_bit(policy, bounds):
    """The trainer and the server normalize uint8 patches where the model is (PixelNorm);
    the model must still get exactly what the image processor would give it."""
    from core.encoding import PixelNorm, prompt_parts
    from core.imaging import QWEN25_VL

    processor = policy.image_processor
    if bounds == "released":  # Qwen2.5-VL's released bounds: a 1920x1080 screen at full size
        processor = QWEN25_VL.processor()
    generator = torch.Generator().manual_seed(0)
    sizes = [(160, 210), (1920, 1080), (37, 500)]
    noise = [torch.randint(0, 256, (h, w, 3), generator=generator, dtype=torch.uint8)
             for w, h in sizes]  # fmt: skip
    images = [Image.fromarray(a.numpy()) for a in noise] + [
        Image.fromarray(noise[0].numpy()).convert("RGBA")
    ]
    expected = processor(images=images, return_tensors="pt")["pixel_values"]
    messages = step_messages()
    messages[1]["content"] = [{"type": "text", "text": "x"}] + [
        {"type": "image_url", "image_url": {"url": _data_url(image)}} for image in images
    ]
    swapped = policy.image_processor
    policy.image_processor = processor
    try:
        parts = prompt_parts(policy, messages)
    finally:
        policy.image_processor = swapped
    assert parts.patches is not None and parts.patches.dtype == torch.uint8
    got = PixelNorm.of(processor).apply(parts.patches)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_converter_rejects_remote_images_naming_the_field():
    bad = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url\.url"):
        to_qwen_messages(bad)


def test_generate_from_a_screenshot_reports_logprobs_and_entropy(policy):
    batch = [step_messages(), step_messages("Type hello."), step_messages()]
    gens = generate(policy, batch, max_new_tokens=12, temperature=1.0, top_p=0.95, seed=[7, 8, 7])
    for gen in gens:
        assert 1 <= gen.response_tokens <= 12
        assert len(gen.token_logprobs) == len(gen.token_ids) == gen.response_tokens
        assert all(lp <= 0 for lp in gen.token_logprobs)
        assert gen.mean_entropy > 0
        assert gen.prompt_tokens > 48
    # Same seed, same prompt: same sample, even when batched with another request.
    assert gens[0].token_ids == gens[2].token_ids
    greedy = generate(policy, [step_messages()], max_new_tokens=5, greedy=True)[0]
    assert (
        greedy.token_ids
        == generate(policy, [step_messages()], max_new_tokens=5, greedy=True)[0].token_ids
    )


def test_rollout_and_training_tokenize_and_score_alike(policy):
    messages = step_messages()
    prompt = encode_prompt(policy, messages)
    gen = generate(policy, [messages], max_new_tokens=16, seed=3)[0]

    # The trainer rebuilds prompt + the sampled tokens exactly ...
    batch, mask = encode_prompt_response(policy, messages, token_ids=gen.token_ids)
    assert batch.input_ids[0, : prompt.input_ids.shape[1]].tolist() == prompt.input_ids[0].tolist()
    assert batch.input_ids[mask].tolist() == gen.token_ids
    # ... and scores them as the sampler did (same temperature-1 distribution).
    with torch.no_grad():
        logprobs, entropy, out_mask = sequence_logprobs(policy.model, batch)
    assert torch.equal(out_mask, mask)
    assert torch.allclose(logprobs[mask], torch.tensor(gen.token_logprobs), atol=1e-4)
    assert abs(float(entropy[mask].mean()) - gen.mean_entropy) < 1e-4

    # A response given as text is its tokens + <|im_end|>, and decodes back to the text.
    # (A random model's samples are rarely the canonical BPE split of their own text,
    # which is why the rollout records token ids and the trainer prefers them.)
    batch, mask = encode_prompt_response(policy, messages, UI_TARS_RESPONSE)
    response = batch.input_ids[mask].tolist()
    assert response[-1] == policy.token_id("<|im_end|>")
    assert policy.tokenizer.decode(response[:-1], skip_special_tokens=False) == UI_TARS_RESPONSE
    assert batch.input_ids[0, : prompt.input_ids.shape[1]].tolist() == prompt.input_ids[0].tolist()


def test_training_forward_has_gradients_only_through_the_response(policy):
    first, _ = encode_prompt_response(policy, step_messages(), UI_TARS_RESPONSE)
    policy.model.zero_grad()
    logprobs, entropy, mask = sequence_logprobs(policy, first)
    assert logprobs.shape == mask.shape == first.input_ids.shape
    # The entropy is measured, never trained on: no graph is kept for it.
    assert logprobs.requires_grad and not entropy.requires_grad and (entropy[mask] > 0).all()
    assert (logprobs[~mask] == 0).all() and (logprobs[mask] < 0).all()
    logprobs.sum().backward()
    assert policy.model.lm_head.weight.grad.abs().sum() > 0
    policy.model.zero_grad()


def test_checkpoint_reload_changes_and_restores_outputs(policy, tmp_path):
    messages = step_messages()
    before = generate(policy, [messages], max_new_tokens=8, greedy=True)[0]
    original = save_checkpoint(policy, tmp_path / "v0")
    assert load_policy(original).model.config.model_type == "qwen3_vl"

    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    perturbed = save_checkpoint(policy, tmp_path / "v1")
    load_weights_into(policy, original)
    restored = generate(policy, [messages], max_new_tokens=8, greedy=True)[0]
    assert restored.token_ids == before.token_ids
    assert restored.token_logprobs == pytest.approx(before.token_logprobs, abs=1e-5)

    load_weights_into(policy, perturbed)
    changed = generate(policy, [messages], max_new_tokens=8, greedy=True)[0]
    assert changed.token_logprobs != pytest.approx(before.token_logprobs, abs=1e-3)
    load_weights_into(policy, original)


def test_replies_never_contain_image_or_turn_tokens(policy):
    """Sampled at high temperature, a random model would emit them; they are suppressed."""
    messages = [{"role": "user", "content": "Click the submit button."}]
    gens = generate(policy, [messages] * 4, max_new_tokens=60, temperature=3.0, seed=[1, 2, 3, 4])
    banned = {policy.token_id(t) for t in NEVER_GENERATED}
    assert all(not banned & set(g.token_ids) for g in gens)
    assert all(t not in g.text for g in gens for t in NEVER_GENERATED)


def test_a_screenshot_shown_again_is_encoded_once_and_alike(policy):
    """Three steps of a trajectory, each showing the last two screenshots: with an image
    cache each screenshot is resized and cut once, and every prompt's ids, patches and grids
    are the ones encoding it alone gives."""
    shots = [screenshot_url(160 + 16 * i, 210) for i in range(3)]
    prompts = [
        [
            {"role": "system", "content": "You are a GUI agent."},
            {
                "role": "user",
                "content": [
                    *(
                        {"type": "image_url", "image_url": {"url": u}}
                        for u in shots[max(0, i - 1) : i + 1]
                    ),
                    {"type": "text", "text": f"step {i}"},
                ],
            },
        ]
        for i in range(3)
    ]
    processed: list[int] = []
    real = policy.image_processor.__class__.__call__

    def counting(self, *args, images, **kwargs):
        processed.append(len(images))
        return real(self, *args, images=images, **kwargs)

    alone = [prompt_parts(policy, m) for m in prompts]
    processed.clear()
    cache = ImageCache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy.image_processor.__class__, "__call__", counting)
        cached = [prompt_parts(policy, m, image_cache=cache) for m in prompts]
    assert sum(processed) == 3 and cache.hits == 2  # 5 images shown, 3 distinct
    for a, b in zip(alone, cached, strict=True):
        assert a.ids == b.ids
        assert torch.equal(a.patches, b.patches) and torch.equal(a.image_grid_thw, b.image_grid_thw)
