"""Image parts of dataset rows: resolved against the dataset file, checked when the rows load."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from grpo_core.data import load_prompts
from grpo_core.errors import DataError
from grpo_core.images import has_images, image_sources, image_url, read_image, resolve_images
from grpo_core.types import Prompt


def png(colour=(200, 10, 10), size=(5, 4)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is it?"}]}]}


def write_rows(folder: Path, *rows: dict) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_relative_paths_resolve_against_the_dataset_file_and_openai_parts_become_image_parts(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    url = data_url(png((0, 0, 255)))
    rows = write_rows(
        tmp_path,
        user({"type": "image", "image": "img/a.png"}),
        user({"type": "image_url", "image_url": {"url": url}}),
        user({"type": "image_url", "image_url": "https://example.com/cat.png"}),
        {"question": "no image here"},
    )
    prompts = load_prompts(rows)
    assert image_sources(prompts[0].messages) == [str((tmp_path / "img" / "a.png").resolve())]
    assert prompts[1].messages[0]["content"][0] == {"type": "image", "image": url}
    assert image_sources(prompts[2].messages) == ["https://example.com/cat.png"]
    assert [has_images(p) for p in prompts] == [True, True, True, False]
    # The text part is kept as the row gave it.
    assert prompts[0].messages[0]["content"][1] == {"type": "text", "text": "what is it?"}


def test_an_absolute_path_and_a_file_url_are_read_where_they_are(tmp_path):
    (tmp_path / "b.png").write_bytes(png())
    rows = write_rows(tmp_path, user({"type": "image", "image": f"file://{tmp_path / 'b.png'}"}))
    assert image_sources(load_prompts(rows)[0].messages) == [str(tmp_path / "b.png")]


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image", "image": "missing.png"}, "image file not found: {folder}/missing.png"),
        ({"type": "image", "image": "not-an-image.png"}, "cannot read image {folder}/not-an-image.png: cannot identify image file"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "data:image/FORMAT;base64,DATA"),
        ({"type": "image", "image": ""}, 'an image part is {{"type": "image", "image": PATH or URL}}'),
        ({"type": "image_url", "image_url": {}}, 'an image part is {{"type": "image_url", "image_url": {{"url": URL}}}}'),
    ],
)
def test_a_bad_image_is_an_error_naming_the_row_and_the_part(tmp_path, part, message):
    (tmp_path / "not-an-image.png").write_text("hello")
    rows = write_rows(tmp_path, {"question": "fine"}, user({"type": "text", "text": "look:"}, part))
    with pytest.raises(DataError) as caught:
        load_prompts(rows)
    text = str(caught.value)
    assert text.startswith(f"{rows}:2: message 1 part 2: "), text
    assert message.format(folder=tmp_path) in text
    assert "\n" not in text


def test_bad_images_are_counted_skips_when_asked(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    rows = write_rows(tmp_path, user({"type": "image", "image": "ok.png"}), user({"type": "image", "image": "gone.png"}))
    skipped: list[str] = []
    prompts = load_prompts(rows, skipped=skipped)
    assert [p.id for p in prompts] == ["rows.jsonl:1"]
    assert len(skipped) == 1 and "rows.jsonl:2: message 1 part 1: image file not found" in skipped[0]


def test_a_relative_path_without_a_folder_is_refused():
    prompt = Prompt(id="hub[0]", messages=[{"role": "user", "content": [{"type": "image", "image": "a.png"}]}])
    with pytest.raises(DataError, match=r"hub\[0\]: message 1 part 1: image 'a.png' is a relative path"):
        resolve_images(prompt, "hub[0]", None)


def test_a_text_prompt_is_returned_as_it_is():
    prompt = Prompt(id="x", messages=[{"role": "user", "content": "hi"}])
    assert resolve_images(prompt, "x", Path("/nowhere")) is prompt


def test_read_image_gives_rgb_and_names_where_it_failed(tmp_path):
    (tmp_path / "grey.png").write_bytes(png())
    from PIL import Image

    grey = tmp_path / "l.png"
    Image.new("L", (3, 3), 7).save(grey)
    image = read_image(str(grey), "row 1")
    assert image.mode == "RGB" and image.size == (3, 3) and image.getpixel((0, 0)) == (7, 7, 7)
    with pytest.raises(DataError, match=r"^prompt p: cannot read image http://127.0.0.1:9/x.png: "):
        read_image("http://127.0.0.1:9/x.png", "prompt p")


def test_image_url_sends_a_file_as_a_data_url_and_a_url_as_it_is(tmp_path):
    raw = png()
    (tmp_path / "a.png").write_bytes(raw)
    assert image_url(str(tmp_path / "a.png")) == data_url(raw)
    assert image_url("https://example.com/a.png") == "https://example.com/a.png"
    assert image_url(data_url(raw)) == data_url(raw)
