"""`axcore serve`: its flags refused in one line (exit 2) before anything loads; the run's tokenizer and template."""

import argparse

import pytest

from axcore.cli import main
from axcore.cli.serve import engine_config, load_frontend
from axcore.data.chat import ChatTemplate
from axcore.experiment import load_experiment
from axcore.serving import RequestError
from axcore.serving.server import ServeError, check_host, is_loopback

BAD_FLAGS = [
    (["--host", "10.1.2.3"], "--host '10.1.2.3' is not a loopback address"),
    (["--host", "0.0.0.0"], "--allow-remote"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-waiting", "0"], "--max-waiting must be >= 1"),
    (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--api-key", " "], "--api-key is empty"),
    (["--lora", "sql"], "--lora 'sql' is not NAME=PATH"),
    (["--max-seqs", "0"], "--max-seqs must be >= 1, got 0"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be a positive number of GiB, got 0.0"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib must be a positive number of GiB, got nan"),
    (["--max-tokens-per-step", "-3"], "--max-tokens-per-step must be >= 1, got -3"),
    (["--max-seqs", "300"], "--max-tokens-per-step 256 is below --max-seqs 300"),
    (["--max-seqs", "8", "--max-tokens-per-step", "4"], "--max-tokens-per-step 4 is below --max-seqs 8"),
    (["--lora", "a=runs/x", "--lora", "a=runs/y"], "--lora 'a=runs/y': the name 'a' is taken"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_a_bad_flag_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    assert main(["serve", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("axcore: error: ") and message in err and err.count("\n") == 1


def test_argparse_refuses_a_port_that_is_no_number(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tmp_path), "--port", "http"])
    assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


def test_loopback_hosts_pass_and_others_need_allow_remote():
    for host in ("127.0.0.1", "127.8.9.10", "::1", "localhost"):
        assert is_loopback(host)
        check_host(host, allow_remote=False)
    for host in ("0.0.0.0", "192.168.1.4", "::"):
        assert not is_loopback(host)
        with pytest.raises(ServeError, match="--allow-remote"):
            check_host(host, allow_remote=False)
        check_host(host, allow_remote=True)


def test_the_engine_flags_set_the_engines_config(tmp_path):
    """Each flag sets its EngineConfig field; a flag not given keeps EngineConfig's default."""
    from axcore.engine import EngineConfig

    args = argparse.Namespace(max_seqs=32, kv_cache_gib=0.5, max_tokens_per_step=512)
    assert engine_config(args) == EngineConfig(max_seqs=32, kv_cache_bytes=512 * 1024 * 1024, max_tokens_per_step=512)
    assert engine_config(argparse.Namespace(max_seqs=None, kv_cache_gib=None, max_tokens_per_step=None)) == \
        EngineConfig()


def _args(**kwargs):
    return argparse.Namespace(**{"chat_template": None, "overrides": [], "objects": None, **kwargs})


def test_the_frontend_takes_the_runs_chat_template_or_the_given_file(tmp_path):
    sft = tmp_path / "sft"
    experiment = load_experiment("sft")
    experiment.save(sft)
    frontend = load_frontend(str(sft), _args())
    messages = [{"role": "user", "content": "Hi"}]
    # The sft experiment trains on chat data rendered with its chat source's template (the built-in default).
    [(_, _, source, where)] = [c for c in experiment.config.input.components() if hasattr(c[2], "template")]
    reference = ChatTemplate.for_tokenizer(experiment.config.tokenizer.instantiate(), source.template, field=where)
    text = reference.render(messages, add_generation_prompt=True)
    assert frontend.render(messages).text == text and frontend.render(messages).token_ids == tuple(text.encode())
    custom = tmp_path / "t.jinja"
    custom.write_text("{% for m in messages %}{{ m['content'] }}END\n{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    chosen = load_frontend(str(sft), _args(chat_template=str(custom)))
    assert chosen.render(messages).text == "HiEND\n>" and chosen.marker == "END"


def test_a_run_without_chat_data_or_template_refuses_chats_only(tmp_path):
    run = tmp_path / "default"
    load_experiment("default").save(run)
    frontend = load_frontend(str(run), _args())
    assert frontend.encode("hé") == (104, 195, 169)
    with pytest.raises(RequestError, match="--chat-template") as caught:
        frontend.render([{"role": "user", "content": "Hi"}])
    assert caught.value.param == "messages" and caught.value.status == 400


def test_precompile_compiles_the_engines_programs_before_the_server_starts(tmp_path, capsys, monkeypatch):
    """`--precompile` calls `Engine.precompile` after the engine loads and before the server runs, and says what it
    compiled on stderr; without it nothing is compiled ahead."""
    import axcore.cli.serve as serve
    import axcore.serving.app as app
    import axcore.serving.server as server

    events = []

    class Engine:
        def precompile(self):
            events.append("precompile")
            return [(4, 1, 64, False, 4), (8, 1, 64, False, 8)]

    class Server:
        def run(self):
            events.append("run")

    monkeypatch.setattr(serve, "build_engine", lambda path, args: Engine())
    monkeypatch.setattr(serve, "load_frontend", lambda path, args: None)
    monkeypatch.setattr(app, "create_app", lambda engine, frontend, settings: None)
    monkeypatch.setattr(server, "make_server", lambda app_, **kwargs: Server())
    assert main(["serve", str(tmp_path), "--precompile"]) == 0
    assert events == ["precompile", "run"]
    assert "compiled 2 step programs in" in capsys.readouterr().err
    events.clear()
    assert main(["serve", str(tmp_path)]) == 0 and events == ["run"]
