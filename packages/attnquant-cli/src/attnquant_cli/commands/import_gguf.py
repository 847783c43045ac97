"""``attnquant import``: a llama.cpp GGUF file as a float32 Hugging Face checkpoint (attnquant-core,
numpy: no MAX, no torch), which every other command then takes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from attnquant_core.io import ImportProgress, import_gguf

from ._shared import JsonFlag, console, out, print_json

__all__ = ["import_command"]


def import_command(
    gguf_file: Annotated[Path, typer.Argument(help="The GGUF file to import.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Checkpoint directory to write.")],
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template",
            exists=True,
            dir_okay=False,
            help="A Jinja chat template file, written in place of the GGUF's (for a GGUF that "
            "carries none, as llama.cpp's --chat-template).",
        ),
    ] = None,
    json_summary: JsonFlag = False,
) -> None:
    """Import a GGUF (Llama, Mistral, Qwen2/3, Gemma 3) as a float32 Hugging Face checkpoint.

    Every tensor is dequantized to float32 and llama.cpp's q/k row order and Gemma's 1 + w norms
    are undone; the tokenizer and chat template come along. Where the GGUF was quantized, the
    imported model is the reference (attnquant.gguf-source.json records each tensor's type).
    Architectures: gemma3, llama (Llama and Mistral), qwen2, qwen3.
    """
    with Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("import", total=None)

        def report(event: ImportProgress) -> None:
            progress.update(task, completed=event.done, total=event.total)

        template = None if chat_template is None else chat_template.read_text(encoding="utf-8")
        summary = import_gguf(
            gguf_file, output, overwrite=overwrite, progress=report, chat_template=template
        )
    if json_summary:
        print_json({"output": str(output), **summary})
        return
    types = ", ".join(f"{n} {t}" for t, n in summary["types"].items())
    note = (
        f"; {summary['quantized']} tensors were quantized in the GGUF, so this float32 model "
        f"(not the one the GGUF was made from) is the reference"
        if summary["quantized"]
        else ""
    )
    if summary["chat_template"] is None:
        note += "; the GGUF has no chat template (give one with --chat-template FILE for chat)"
    out.print(
        f"{output}: {summary['hf_architecture']} from {gguf_file.name} ({summary['tensors']} "
        f"tensors: {types}), {summary['float32_bytes']:,} bytes in float32{note}",
        highlight=False,
        soft_wrap=True,
    )
