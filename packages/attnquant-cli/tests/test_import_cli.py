"""attnquant import: a GGUF in, a checkpoint every other command takes out (the demo model's
float32 GGUF round-trips to the same model), and repeated --data as the README shows it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from attnquant_cli import cli
from attnquant_cli._demo import demo_model_path
from attnquant_core.io import SOURCE_FILE, export_gguf


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_import_of_the_demos_gguf_evaluates_as_the_demo(tmp_path: Path, capsys) -> None:
    path = export_gguf(demo_model_path(), tmp_path / "demo.gguf")
    out = tmp_path / "imported"
    assert cli(["import", str(path), "-o", str(out), "--json"]) == 0
    summary = _last_json(capsys)
    assert summary["hf_architecture"] == "LlamaForCausalLM" and summary["quantized"] == 0
    assert (out / SOURCE_FILE).is_file() and (out / "tokenizer.json").is_file()
    texts = []
    for i, body in enumerate(("def f(x):\n    return x * 2\n", "class A:\n    pass\n\n\n")):
        texts += ["--data", str(tmp_path / f"{i}.py")]
        (tmp_path / f"{i}.py").write_text(body * 3)
    rc = cli(["eval", "demo", str(out), *texts, "--forward", "numpy", "--json"])
    assert rc == 0
    figures = _last_json(capsys)
    assert len(figures["data"]) == 2 and figures["reference"] is None
    demo, imported = figures["results"]
    assert imported["kl"] == 0.0 and imported["top1_agreement"] == 1.0
    assert imported["perplexity"] == demo["perplexity"]
    # an existing output is refused with one line, and kept
    assert cli(["import", str(path), "-o", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_quantized_import_says_its_reference_is_the_dequantized_model(
    tmp_path: Path, capsys
) -> None:
    src = export_gguf(demo_model_path(), tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(str(src))
    q8 = tmp_path / "q8.gguf"
    w = gguf.GGUFWriter(str(q8), "llama")
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        data = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        if data.ndim == 2 and "blk." in t.name:
            w.add_tensor(
                t.name,
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "q8"
    assert cli(["import", str(q8), "-o", str(out)]) == 0
    assert "is the reference" in capsys.readouterr().out
    (tmp_path / "t.py").write_text("def f(x):\n    return x * 2\n" * 4)
    rc = cli(
        ["eval", str(out), "demo", "--data", str(tmp_path / "t.py"), "--forward", "numpy", "--json"]
    )
    assert rc == 0
    figures = _last_json(capsys)
    assert figures["reference"].startswith("reference: q8, dequantized from q8.gguf (42 tensors")
    _, demo = figures["results"]
    assert 0 < demo["kl"] < 0.01  # Q8_0 is near the float32 demo, not equal to it


def test_data_given_twice_without_repeating_the_option_gets_a_hint(tmp_path: Path, capsys) -> None:
    rc = cli(["calibrate", "demo", "--data", "a.txt", "b.txt", "-o", str(tmp_path / "s")])
    assert rc == 2
    assert "--data A --data B" in capsys.readouterr().err


def test_a_chat_template_is_given_where_the_gguf_has_none(tmp_path: Path, capsys) -> None:
    """The demo's GGUF carries no chat template (as the Gemma 3 270M package's does not):
    import says so, and --chat-template FILE writes one."""
    path = export_gguf(demo_model_path(), tmp_path / "demo.gguf")
    assert cli(["import", str(path), "-o", str(tmp_path / "plain")]) == 0
    assert "no chat template" in capsys.readouterr().out
    assert "chat_template" not in json.loads((tmp_path / "plain/tokenizer_config.json").read_text())
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    out = tmp_path / "chat"
    assert cli(["import", str(path), "-o", str(out), "--chat-template", str(template)]) == 0
    assert "no chat template" not in capsys.readouterr().out
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == template.read_text()
    assert json.loads((out / SOURCE_FILE).read_text())["chat_template"] == "given"
    template.write_text("  \n")
    assert (
        cli(["import", str(path), "-o", str(tmp_path / "empty"), "--chat-template", str(template)])
        == 2
    )
    assert "chat template given is empty" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()
