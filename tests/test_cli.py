"""The `slipstream` command line: answers without torch where it can, checks
options before loading, and guides a first run (chat template, empty prompt,
context limit, analyze without matplotlib)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
_PROBE = ("import sys, time; t = time.perf_counter(); from slipstream.cli import main\n"
          "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
          "print('RESULT', rc, 'torch' in sys.modules, round(time.perf_counter() - t, 3))")


def _probe(*argv):
    """Run the CLI in a fresh interpreter: (exit code, torch imported?, seconds, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    last = [line for line in r.stdout.splitlines() if line.startswith("RESULT")][-1].split()
    return int(last[1]), last[2] == "True", float(last[3]), r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["chat", "--help"]])
def test_help_without_torch(argv):
    rc, torch_loaded, seconds, out = _probe(*argv)
    assert rc == 0 and not torch_loaded
    assert "usage: slipstream" in out
    assert seconds < 5   # generous for a loaded CI machine; about 0.05 s idle


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be in [0.0, inf], got -1.0"),
    (["--top-p", "0"], "--top-p must be in (0.0, 1.0], got 0.0"),
    (["--top-k", "-3"], "--top-k must be"),
    (["--min-p", "2"], "--min-p must be in [0.0, 1.0]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be in (0.0"),
    (["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["--max-model-len", "1"], "argument --max-model-len: must be at least 2"),
    (["--dtype", "f32"], "argument --dtype: invalid choice: 'f32'"),
    (["--device", "gpu"], "argument --device: expected auto, cpu, cuda or cuda:N"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "-3"],
     "argument --num-speculative-tokens: must be in [1, 16], got -3"),
    (["--num-speculative-tokens", "0"], "argument --num-speculative-tokens: must be in [1, 16], got 0"),
    (["--speculative-draft-layers", "0"], "argument --speculative-draft-layers: must be at least 1"),
    (["-m", ""], "argument --model/-m: the path is empty; leave out --model for the default model"),
])
def test_option_errors_come_before_any_load(argv, message):
    rc, torch_loaded, seconds, out = _probe("generate", "hello", *argv)
    assert rc == 2 and message in out, out
    assert len(out.strip().splitlines()) == 2, out      # RESULT, then one line: not the whole usage
    assert not torch_loaded, "the model (and torch) must not load for a bad option"
    assert seconds < 5


@pytest.mark.parametrize("chat", [[], ["--chat"], ["--raw"]])
def test_empty_prompt_is_refused_the_same_way(chat):
    rc, torch_loaded, _, out = _probe("generate", "  ", *chat)
    assert rc == 2 and "the prompt is empty" in out and not torch_loaded


def test_every_command_has_a_module_with_add_parser():
    import importlib
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "add_parser", None) or mod.add_parsers) and help_text


def test_raw_prompt_on_a_chat_model_gets_the_hint(capsys):
    rc = main(["generate", "What is the capital of Japan?", "--raw", "-t", "0", "--max-tokens", "8",
               "--max-model-len", "128"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "drop --raw" in err and "chat template" in err
    assert "loaded llama in" in err   # the load time is reported


def test_a_stop_string_at_once_gets_no_hint(capsys, monkeypatch):
    """A stop string that matched the first token is not the model ending its turn."""
    from slipstream.commands import options
    real = options.stream
    seen = []

    def stop_at_once(engine, prompt, params):
        seen.append(real(engine, prompt, params))
        return "", 1, 0.1, 0.1, "stop", "Tokyo"
    monkeypatch.setattr(options, "stream", stop_at_once)
    rc = main(["generate", "What is the capital of Japan?", "--raw", "-t", "0", "--max-tokens", "4",
               "--max-model-len", "128", "--stop", "Tokyo"])
    assert rc == 0 and len(seen[0]) == 6 and "drop --raw" not in capsys.readouterr().err


def test_chat_template_is_applied_by_default(capsys):
    rc = main(["generate", "What is the capital of Japan?", "-t", "0", "--max-tokens", "12",
               "--max-model-len", "128"])
    out = capsys.readouterr()
    assert rc == 0 and "Tokyo" in out.out
    assert "drop --raw" not in out.err


def test_context_limit_is_reported(capsys):
    rc = main(["generate", "Count from one to one hundred:", "--raw", "-t", "0", "--max-tokens", "200",
               "--max-model-len", "24"])
    err = capsys.readouterr().err
    assert rc == 0 and "stopped at the context limit of 24 tokens" in err


def test_analyze_prints_the_analysis_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    rc = main(["analyze", "llama-3-8b", "--plot", str(tmp_path / "r.png")])
    out = capsys.readouterr()
    assert rc == 2
    assert "llama-3-8b" in out.out and "lm_head" in out.out   # the analysis came out first
    assert "matplotlib" in out.err and not (tmp_path / "r.png").exists()


def test_generate_streams_greedy_prompts_through_the_device_loop(capsys):
    """--spec-device-loop: `generate` answers a greedy prompt through the EAGLE loop
    (streamed after each batch of rounds) with plain decoding's text."""
    args = ["generate", "List three uses of a paper clip.", "-t", "0", "--max-tokens", "24",
            "--max-model-len", "256"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    loop = ["--speculative-method", "eagle", "--num-speculative-tokens", "3", "--spec-tree", "2,2,4",
            "--spec-device-loop"]
    from slipstream.spec.loop_path import LoopPath
    calls = []
    real = LoopPath.generate

    def counted(self, *a, **kw):
        calls.append(kw.get("on_text") is not None)
        return real(self, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LoopPath, "generate", counted)
        assert main(args + loop) == 0
    out = capsys.readouterr()
    assert calls == [True] and out.out == plain
    assert "tokens in" in out.err


def test_serve_refuses_the_device_loop_before_loading():
    rc, torch_loaded, _, out = _probe("serve", "--speculative-method", "eagle", "--spec-device-loop")
    assert rc == 2 and "drop --spec-device-loop" in out and not torch_loaded


def test_engine_errors_name_the_flags(capsys):
    """The engine's messages name Python fields; the command line shows its flags."""
    rc = main(["generate", "hi", "--max-model-len", "999999", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-model-len=999999 exceeds" in err and "max_model_len" not in err


def test_speculative_options_without_a_method_are_refused(capsys):
    """--spec-tree and the other speculative options do nothing without
    --speculative-method: an error naming them, not plain decoding in silence."""
    rc = main(["generate", "hi", "--spec-tree", "4,4,16", "--spec-online", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "--spec-tree, --spec-online need --speculative-method" in err, err
    from slipstream.engine.args import EngineArgs
    with pytest.raises(ValueError, match="speculative_draft_layers needs speculative_method"):
        EngineArgs(speculative_draft_layers=3).spec_config()


@pytest.mark.parametrize("content, message", [
    (b"not a safetensors file", "is not a safetensors file of eagle heads"),
    (None, "is a medusa head file, not eagle heads")])
def test_a_bad_head_file_is_one_line(tmp_path, content, message):
    """--speculative-model naming a file that is not a head of that kind: one line."""
    from slipstream.errors import ModelLoadError
    from slipstream.spec.heads import resolve_head
    path = tmp_path / "head.safetensors"
    if content is None:
        import torch
        from safetensors.torch import save_file
        save_file({"w1": torch.zeros(2, 2)}, str(path), metadata={"kind": "medusa"})
    else:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        resolve_head(str(path), "eagle")


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "100"], "argument --group-size: expected 0 (per channel) or a multiple of 32, got 100"),
    (["--method", "gptq", "--damp", "-1"], "argument --damp: must be in (0.0, 1.0], got -1"),
    (["--damp", "0"], "argument --damp: must be in (0.0, 1.0], got 0"),
    (["--damp", "1.5"], "argument --damp: must be in (0.0, 1.0], got 1.5"),
    (["--num-windows", "0"], "argument --num-windows: must be at least 1, got 0"),
    (["--seq-len", "1"], "argument --seq-len: must be at least 2, got 1"),
    (["--clip-grid", "-1"], "argument --clip-grid: must be at least 0, got -1"),
    (["--alpha", "2"], "argument --alpha: must be in [0.0, 1.0], got 2"),
    (["--asym-calib", "nan"], "argument --asym-calib: must be in [0.0, 1.0], got nan"),
    (["--method", "bogus"], "argument --method: invalid choice: 'bogus'"),
    (["--mixed-bits", "3,5"], "argument --mixed-bits: each width must be 2, 3, 4 or 8"),
    (["--method", "mixed", "--avg-bits", "2.5"], "--avg-bits 2.5 is below the smallest of --mixed-bits (3)"),
])
def test_quantize_options_are_checked_before_anything_loads(argv, message):
    """A bad number fails at once (exit 2, one line), not after loading and
    calibrating (a LinAlgError from --damp -1, a ZeroDivisionError from
    --num-windows 0)."""
    rc, torch_loaded, seconds, out = _probe("quantize", "-o", "/tmp/never-written", *argv)
    assert rc == 2 and message in out, out
    assert len(out.strip().splitlines()) == 2, out
    assert not torch_loaded and seconds < 5


@pytest.mark.parametrize("argv, message", [
    (["bench", "throughput", "--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["eval", "ppl", "--text", "t.txt", "--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
])
def test_other_commands_check_options_before_anything_loads(argv, message):
    rc, torch_loaded, seconds, out = _probe(*argv)
    assert rc == 2 and message in out, out
    assert not torch_loaded and seconds < 5


def test_quantize_methods_are_the_quantizers():
    from slipstream.quant import cli
    from slipstream.quant.quantizer import METHODS
    assert cli.METHODS == METHODS


@pytest.mark.parametrize("method", ["medusa", "eagle", "peagle"])
def test_shipped_heads_are_refused_for_another_model(tmp_path, capsys, method):
    """The shipped heads are SmolLM2-135M's: on another model without
    --speculative-model, one line before anything loads (not an IndexError or a
    feature-tap error after the load)."""
    rc = main(["generate", "hi", "-m", str(tmp_path), "--speculative-method", method])
    err = capsys.readouterr().err
    assert rc == 2 and f"no shipped {method} heads for the model" in err, err
    assert "pass --speculative-model=PATH" in err and "loading" not in err
    from slipstream.engine.args import EngineArgs
    with pytest.raises(ValueError, match=f"no shipped {method} heads.*speculative_model=PATH"):
        EngineArgs(model=str(tmp_path), speculative_method=method).spec_config()
    # the default model (None, or its file) keeps its heads; a head file named is used as is
    from slipstream.loader import default_model_path
    for model in (None, str(default_model_path())):
        assert EngineArgs(model=model, speculative_method=method).spec_config().model is None
    head = str(tmp_path / "h.safetensors")
    assert EngineArgs(model=str(tmp_path), speculative_method=method,
                      speculative_model=head).spec_config().model == head


def test_draft_needs_a_draft_model_or_layers(tmp_path):
    """speculative_method='draft' alone would draft with the whole target (every
    draft a target step): refused; with draft layers the target's own first layers
    draft (not the default model's)."""
    from slipstream.engine.args import EngineArgs
    with pytest.raises(ValueError, match="'draft' needs speculative_model .* or speculative_draft_layers"):
        EngineArgs(model=str(tmp_path), speculative_method="draft").spec_config()
    cfg = EngineArgs(model=str(tmp_path), speculative_method="draft",
                     speculative_draft_layers=1).spec_config()
    assert cfg.model == str(tmp_path) and cfg.draft_num_layers == 1
    assert EngineArgs(model=str(tmp_path), speculative_method="draft",
                      speculative_model="d").spec_config().model == "d"


def test_draft_min_prob_is_checked():
    from slipstream.engine.args import EngineArgs
    with pytest.raises(ValueError, match="speculative_draft_min_prob needs speculative_method"):
        EngineArgs(speculative_draft_min_prob=0.3).spec_config()
    with pytest.raises(ValueError, match="applies to speculative_method='eagle'"):
        EngineArgs(speculative_method="ngram", speculative_draft_min_prob=0.3).spec_config()
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
            EngineArgs(speculative_method="eagle", speculative_draft_min_prob=bad).spec_config()
    assert EngineArgs(speculative_method="eagle",
                      speculative_draft_min_prob=0.3).spec_config().draft_min_prob == 0.3
    from slipstream.cli import build_parser
    args = build_parser("bench").parse_args(["bench", "latency", "--spec-draft-min-prob", "0.25"])
    assert args.speculative_draft_min_prob == 0.25


def test_zero_speculative_tokens_without_a_method_is_refused():
    from slipstream.engine.args import EngineArgs
    for field in ("num_speculative_tokens", "speculative_draft_layers"):
        with pytest.raises(ValueError, match=f"{field} needs speculative_method"):
            EngineArgs(**{field: 0}).spec_config()


def test_a_preset_name_without_dummy_is_one_clear_line(capsys):
    rc = main(["generate", "hi", "-m", "llama-3-8b"])
    err = capsys.readouterr().err
    assert rc == 2 and "'llama-3-8b' is a model shape without weights" in err, err
    assert err.count("load-format") == 1 and "loading" not in err, err


def test_chat_answers_slash_commands_itself(monkeypatch, capsys):
    """An unknown /command is not sent to the model as a prompt; /help lists them;
    // sends a message that begins with /."""
    import io
    from types import SimpleNamespace
    from slipstream.commands import options
    tok = SimpleNamespace(chat_template="t", apply_chat_template=lambda m, **_: m[-1]["content"],
                          encode=lambda text, **_: [1, 2])
    monkeypatch.setattr(options, "make_engine", lambda args: SimpleNamespace(tokenizer=tok))
    sent = []

    def stream(engine, prompt, params):
        sent.append(prompt["prompt"])
        return "ok", 1, 0.1, 0.1, "stop", None
    monkeypatch.setattr(options, "stream", stream)
    monkeypatch.setattr(options, "note_context_limit", lambda *a: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/foo\n/help\n/usr/bin is a path\n//x\n/exit\nnever\n"))
    assert main(["chat", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "unknown command /foo; /help lists them" in err
    assert "/reset" in err and "/help" in err
    assert sent == ["/usr/bin is a path", "/x"]


def test_chat_reads_piped_input_without_prompts(monkeypatch, capsys):
    """Piped into `slipstream chat`, the replies alone go to stdout (no "> ")."""
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say yes.\n"))
    rc = main(["chat", "-t", "0", "--max-tokens", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and out.strip() and not out.startswith(">") and "\n> " not in out, out


def test_unknown_options_are_named_by_their_subcommand():
    rc, torch_loaded, _, out = _probe("generate", "hi", "--bogus")
    assert rc == 2 and not torch_loaded
    assert "slipstream generate: error: unrecognized arguments: --bogus (see slipstream generate --help)" in out
    rc, _, _, out = _probe("bench", "latency", "--bogus")
    assert rc == 2 and "slipstream bench latency: error: unrecognized arguments: --bogus" in out


def test_bench_takes_the_speculative_flags_of_generate():
    """bench latency / throughput spell the engine fields out (--speculative-tree) and
    take generate's shorter spellings too (--spec-tree, --no-spec-auto-off)."""
    from slipstream.cli import build_parser
    args = build_parser("bench").parse_args(["bench", "latency", "--spec-tree", "4,4,16",
                                             "--no-spec-auto-off", "--spec-online"])
    assert args.speculative_tree == "4,4,16" and args.speculative_auto_off is False
    assert args.speculative_online is True
