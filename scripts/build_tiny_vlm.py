"""Build a tiny random LLaVA-style vision-language model and a few image rows (docs/images.md).

    python scripts/build_tiny_vlm.py --out tiny-llava [--seed 0]

Nothing is downloaded and nothing is trained: a CLIP vision tower of 2 layers (28x28 images,
14x14 patches: 4 image tokens), a 2-layer Llama, the embedded default model's tokenizer with an
``<image>`` token, and a ``LlavaProcessor`` with the PIL image processor and a chat template that
renders image parts; it builds in about a second. The folder loads through transformers'
``AutoProcessor`` / ``AutoModelForImageTextToText`` and ``grpo-core run --model FOLDER`` takes it.

Beside the model it writes ``FOLDER/data/``: six PNG images of solid colours and ``rows.jsonl``,
whose rows ask for an image's colour with transformers' image parts (paths relative to the file),
OpenAI's ``image_url`` parts with a data URL, and a row of two images.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 60),
    "blue": (40, 60, 220),
    "yellow": (230, 220, 40),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
}
IMAGE_SIDE = 28
PATCH = 14
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Renders an image part as one ``<image>``, which the processor expands to the image's 4 tokens."""


def build_model(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from grpo_core.embedded import ASSETS

    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIDE, patch_size=PATCH
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(out)
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops again
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


def png_bytes(colour: tuple[int, int, int], size: tuple[int, int] = (40, 32)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_rows(folder: Path) -> Path:
    """The images and ``rows.jsonl`` in ``folder``; returns the rows' path."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, colour in COLOURS.items():
        (folder / f"{name}.png").write_bytes(png_bytes(colour))
        question = {"type": "text", "text": "What colour is this image?"}
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"{name}.png"}, question]}], "answer": name})
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(COLOURS["blue"])).decode()
    openai_part = {"type": "image_url", "image_url": {"url": data_url}}
    rows.append(
        {"messages": [{"role": "user", "content": [openai_part, {"type": "text", "text": "What colour is this image?"}]}], "answer": "blue"}
    )
    two = [{"type": "image", "image": "red.png"}, {"type": "image", "image": "green.png"}, {"type": "text", "text": "Which is red?"}]
    rows.append({"messages": [{"role": "user", "content": two}], "answer": "first"})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tiny-llava"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_model(args.out, args.seed)
    rows = write_rows(args.out / "data")
    print(f"wrote a tiny LLaVA-style model to {args.out} and image rows to {rows}")


if __name__ == "__main__":
    main()
