"""Secrets reach the jobs but never a log: MLflow params, logged config files, printed lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config import ConfigError
from hpc.config.secrets import MASK, redact_uri, redacted
from tests.fixtures.recipes import NO_VLLM, resolve_recipe

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "kimi-k2.6-dspark.yaml"


@pytest.mark.parametrize("uri,shown", [
    ("https://alice:s3cret@mlflow.example.org/", "https://alice:***@mlflow.example.org/"),
    ("postgresql://svc:pw@db:5432/mlflow", "postgresql://svc:***@db:5432/mlflow"),
    ("https://tok@mlflow.example.org", "https://***@mlflow.example.org"),
    ("http://host:5000/?token=abc&x=1", "http://host:5000/?token=***&x=***"),  # every query value
    ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
])
def test_uris_lose_their_credentials(uri, shown):
    assert redact_uri(uri) == shown


def test_a_logged_config_has_no_secrets_and_the_job_keeps_them():
    cfg = resolve_recipe(KIMI, ["verifier.env={HF_TOKEN: hf_abc, VLLM_CPU_KVCACHE_SPACE: '4'}",
                                "tracking.uri=https://alice:s3cret@mlflow.example.org"])
    shown = redacted(cfg)
    assert shown.verifier.env == {"HF_TOKEN": MASK, "VLLM_CPU_KVCACHE_SPACE": MASK}  # every env value
    assert "s3cret" not in shown.tracking.uri
    assert cfg.verifier.env["HF_TOKEN"] == "hf_abc" and "s3cret" in cfg.tracking.uri  # the original is untouched


def test_validate_errors_do_not_print_secrets():
    with pytest.raises(ConfigError) as info:
        resolve_recipe(KIMI, ["verifier.env={HF_TOKEN: \"hf_abc\\n\"}", "tracking.uri=htps://alice:s3cret@host"])
    text = str(info.value)
    assert "verifier.env.HF_TOKEN" in text and "tracking.uri" in text
    assert "hf_abc" not in text and "s3cret" not in text


def test_secret_flags_of_vllm_are_masked_in_logged_params():
    """Validation refuses them (below), but a command line or an unchecked config can still hold
    them: vLLM takes both spellings of a flag, and a proxy URL with a password under any name."""
    from hpc.config import load_config, to_object

    cfg = to_object(load_config(str(KIMI), ["verifier.extra_args=[--hf-token, hf_5, --api_key=sk-6, --max-num-seqs, '64']",
                                       "verifier.env.HTTPS_PROXY=http://u:pw7@proxy:3128"]))
    assert redacted(cfg).verifier.extra_args == ["--hf-token", MASK, f"--api_key={MASK}", "--max-num-seqs", "64"]
    assert redacted(cfg).verifier.env["HTTPS_PROXY"] == MASK
    assert cfg.verifier.extra_args[1] == "hf_5"
    from hpc.config.secrets import redact_args

    plain = ["--skip-tokenizer-init", "--enforce-eager", "--max-num-batched-tokens", "8192", "--tokenizer", "t"]
    assert redact_args(plain) == plain  # "token" in a flag's name is not a secret
    assert redact_args(["--hf_token", "hf_8"]) == ["--hf_token", MASK]


def test_flags_our_servers_own_are_refused_in_extra_args():
    """vLLM takes the last of a repeated flag: --host 0.0.0.0 undid the 127.0.0.1 bind that
    verifier.host refuses, --api-key replaced the job's own key (our clients then got 401), and
    vLLM prints a --hf-token into its log with its other arguments."""
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, ["verifier.extra_args=[--host, 0.0.0.0, --hf_token=hf_9, --api-key, k, --max-num-seqs, '64']"])
    lines = str(err.value).splitlines()
    assert "verifier.extra_args = '--host': set verifier.host instead" in lines
    assert any(line.startswith("verifier.extra_args = '--hf-token': set verifier.env.HF_TOKEN") for line in lines)
    assert any(line.startswith("verifier.extra_args = '--api-key'") for line in lines)
    assert "hf_9" not in str(err.value) and not any("max-num-seqs" in line for line in lines)


def test_a_vllm_server_log_names_the_command_without_its_secrets(tmp_path):
    from hpc.verifier.vllm_server import start_vllm_server

    server = start_vllm_server("/bin/true", "m", port=1, wait=False, log_path=tmp_path / "s.log", base_args=[],
                               extra_args=["--hf-token", "hf_10", "--api-key=k11", "--x", "http://u:pw12@h/"])
    server.proc.wait()
    server.stop()  # its temp dirs go with it
    first = (tmp_path / "s.log").read_text().splitlines()[0]
    assert f" --hf-token {MASK} --api-key={MASK} --x http://u:{MASK}@h/ --middleware " in first
    assert not any(s in first for s in ("hf_10", "k11", "pw12"))


def test_an_error_message_quoting_the_uri_loses_its_password():
    """MLflow's exceptions quote the request URL, credentials and all; warnings printed them."""
    from hpc.config.secrets import scrub, without_credentials

    text = "API request to http://alice:s3cret@127.0.0.1:9/api/2.0/mlflow/runs/create failed (https://u:p@h/x)"
    assert scrub(text) == ("API request to http://alice:***@127.0.0.1:9/api/2.0/mlflow/runs/create failed "
                           "(https://u:***@h/x)")
    assert without_credentials("https://alice:s3cret@mlflow.example.org/x") == "https://mlflow.example.org/x"
    # What redact_uri masks, scrub masks too: a token alone, a password holding '@', a query token.
    assert scrub("at https://ghp_TOK@h/ and postgresql://bob:p@ss@db/m and http://h:5000/?token=SEC&x=1") == (
        "at https://***@h/ and postgresql://bob:***@db/m and http://h:5000/?token=***&x=***")



@pytest.mark.parametrize("override", ["verifier.env.HF_TOKEN.x=S3CRET", "verifier.env.HF_TOKEN=[S3CRET, b]"])
def test_a_type_error_under_verifier_env_does_not_print_the_value(override):
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [override])
    assert "S3CRET" not in str(err.value) and "verifier.env = '***': must be a mapping" in str(err.value)


@pytest.mark.parametrize("uri", ["http://h:abc", "http://h:99999", "http://u:pw@[::1"])
def test_a_malformed_tracking_uri_is_one_line_not_a_traceback(uri):
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [f"tracking.uri={uri}"])
    (line,) = [ln for ln in str(err.value).splitlines() if ln.startswith("tracking.uri")]
    assert "not a valid URI" in line and "pw" not in line


def test_the_outcome_tag_of_a_failed_pipeline_holds_no_password():
    """MLflow's error text quotes the request URL; the report stage put it into the parent run's tag."""
    from hpc.track.pipeline import end_pipeline_run

    tags = {}

    class Client:
        def set_tag(self, run_id, key, value):
            tags[key] = value

        def set_terminated(self, run_id, status):
            tags["status"] = status

    end_pipeline_run(Client(), "r1", "FAILED", "the report failed: API request to http://u:PW13@mlflow:5000/x failed")
    assert "PW13" not in str(tags) and tags["status"] == "FAILED"


def test_unpinned_remote_code_is_a_login_node_warning(capsys):
    """trust_remote_code runs the hub's *.py on every node: unpinned, whatever main holds at job time."""
    from hpc.launch.validate_cli import run

    args = type("A", (), {"config": str(KIMI), "overrides": NO_VLLM, "offline": True, "print": False})()
    assert run(args) == 0
    err = capsys.readouterr().err
    assert "warning: verifier.revision is unset with verifier.trust_remote_code=true" in err
    # The recipe's EAGLE-3 rival is a hub draft too: vLLM loads whatever its main branch holds.
    assert "warning: eval.compare[0].revision is unset: eagle3 is loaded from lightseekorg/" in err
    args.overrides = [*NO_VLLM, "verifier.revision=" + "a" * 40, "eval.compare.0.revision=" + "b" * 40]
    assert run(args) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_extra_args_value_in_an_error_line_is_masked():
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, ['verifier.extra_args=[--hf-token, "hf_S16\t"]'])
    assert "hf_S16" not in str(err.value) and "verifier.extra_args[1] = '***'" in str(err.value)



@pytest.mark.parametrize("flag, owned", [("--hos", "--host"), ("--ho", "--host"), ("--po", "--port"),
                                         ("--hf-tok", "--hf-token"), ("--hf_to=x", "--hf-token"),
                                         ("--api", "--api-key"), ("--ssl-keyfile-pass", "--ssl-keyfile-password")])
def test_an_abbreviated_owned_flag_is_refused_as_the_flag_it_abbreviates(flag, owned):
    """vLLM's argument parser takes any unambiguous prefix of a long flag: `--hos 0.0.0.0` is
    `--host 0.0.0.0`, which undid the 127.0.0.1 bind."""
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, [f"verifier.extra_args=[{flag}, v]"])
    line = next(x for x in str(err.value).splitlines() if x.startswith("verifier.extra_args"))
    assert f"reads it as {owned} (an abbreviation)" in line


def test_real_flags_that_merely_share_a_prefix_pass():
    from hpc.config.secrets import SECRET_FLAGS, names_flag

    # --ssl-keyfile is vLLM's own flag (an exact match wins over an abbreviation); the others
    # are not prefixes of anything we own.
    for arg in ("--ssl-keyfile", "--max-num-seqs", "--hf-config-path", "--enforce-eager", "-h", "--"):
        assert names_flag(arg, SECRET_FLAGS) is None, arg
    assert names_flag("--hf-tok=abc", SECRET_FLAGS) == "--hf-token"


def test_secrets_are_masked_by_value_not_only_by_name():
    """Each of these reached MLflow's params verbatim: an abbreviated token flag, an Azure
    connection string under a plain name, and a tracking URI's `?access=` query."""
    from hpc.config import load_config, to_object
    from hpc.config.secrets import redact_args, redact_uri

    conn = "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0S0VZ==;EndpointSuffix=core"
    cfg = to_object(load_config(str(KIMI), ["verifier.extra_args=[--hf-tok, hf_abcdefghijklmnopqrstu, --max-num-seqs, '64']",
                                       f"verifier.env.AZURE_STORAGE_CONNECTION_STRING='{conn}'",
                                       "verifier.env.MY_VAR=ghp_abcdefghijklmnopqrstuvwx",
                                       "verifier.env.VLLM_LOGGING_LEVEL=INFO",
                                       "tracking.uri='https://mlflow.example/?access=XYZ123&workspace=a'"]))
    out = redacted(cfg)
    assert out.verifier.extra_args == ["--hf-tok", MASK, "--max-num-seqs", "64"]
    assert out.verifier.env["AZURE_STORAGE_CONNECTION_STRING"] == MASK
    # Every env value, plainly named or not: secrets sit there under names nobody can list.
    assert out.verifier.env["MY_VAR"] == MASK and out.verifier.env["VLLM_LOGGING_LEVEL"] == MASK
    assert out.tracking.uri == f"https://mlflow.example/?access={MASK}&workspace={MASK}"
    # A token-shaped word in extra_args is masked even after a flag we do not know takes secrets.
    assert redact_args(["--some-flag", "sk-abcdefghijklmnopqrstuvwx", "--x=hf_abcdefghijklmnopqrstu"]) == \
        ["--some-flag", MASK, f"--x={MASK}"]
    # Plain values stay readable: paths, numbers, model ids, a short query value.
    for plain in ("/shared/venvs/vllm/bin/python", "8192", "moonshotai/Kimi-K2.6", "0,1,2,3"):
        assert redact_args([plain]) == [plain]
    assert redact_uri("http://h:5000/x") == "http://h:5000/x" and redact_uri("http://h:5000/?x=1") == \
        f"http://h:5000/?x={MASK}"


PARSER_PROBE = r"""
import contextlib, io, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser

parser = make_arg_parser(FlexibleArgumentParser())
owned = [f for f in json.loads(sys.argv[1]) if f in parser._option_string_actions]  # this vLLM's flags
dests = {parser._option_string_actions[f].dest: f for f in owned}
defaults = vars(parser.parse_args([]))
value = {"--port": "4321"}
out = []
for flag in owned:
    for end in range(3, len(flag) + 1):
        for word in {flag[:end], "--" + flag[2:end].replace("-", "_")}:
            for argv in ([word, value.get(flag, "1.2.3.4")], [word + "=" + value.get(flag, "1.2.3.4")]):
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        ns = vars(parser.parse_args(argv))
                except SystemExit:  # unknown, or ambiguous: vLLM refuses it itself
                    continue
                out.append([argv[0], [dests[d] for d in dests if ns[d] != defaults[d]]])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_spelling_vllms_parser_takes_for_an_owned_flag_is_refused(vllm_python):
    """Ask vLLM's own argument parser which words it reads as each flag we own (prefixes, `_`
    for `-`, `=VALUE`), and refuse every one of them in verifier.extra_args."""
    import json
    import subprocess

    from hpc.config.secrets import names_flag
    from hpc.config.validate_ops import OWNED_FLAGS

    res = subprocess.run([str(vllm_python), "-c", PARSER_PROBE, json.dumps(list(OWNED_FLAGS))],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    taken = json.loads(res.stdout.splitlines()[-1])
    assert len(taken) > 4 * len(OWNED_FLAGS)  # abbreviations are on in this vLLM: the probe saw them
    for word, flags in taken:
        assert len(flags) == 1, (word, flags)
        assert names_flag(word, OWNED_FLAGS) == flags[0], word


def test_a_secret_is_masked_wherever_interpolation_carries_it(monkeypatch, capsys):
    """`--print verifier.env.HF_TOKEN=x 'tracking.experiment=${verifier.env.HF_TOKEN}'` printed the
    token in clear, and `${oc.env:VAR}` pulled any secret of the environment into an unmasked key."""
    from hpc.config import secrets
    from hpc.launch.validate_cli import run

    monkeypatch.setattr(secrets, "KNOWN", set())
    monkeypatch.setenv("HF_TOKEN", "hf_Zq8Tn2Lr5Wv9Xc3Bm7Kd")  # a secret by its value
    monkeypatch.setenv("DB_PASSWORD", "opensesame")  # by its variable's name
    monkeypatch.setenv("SCRATCH", "/scratch/alice")  # neither: shown as it is
    overrides = [*NO_VLLM, "verifier.env.TOKEN=tiny", "tracking.experiment=${verifier.env.TOKEN}",
                 "tracking.registered_model=${oc.env:DB_PASSWORD}", "cluster.account=${oc.env:HF_TOKEN}",
                 "data.output_dir=${oc.env:SCRATCH}/x-${oc.env:HF_TOKEN}", "train.output_dir=${oc.env:SCRATCH}/t"]
    args = type("A", (), {"config": str(KIMI), "overrides": overrides, "offline": True, "print": True})()
    assert run(args) == 0
    out = capsys.readouterr().out
    for secret in ("tiny", "opensesame", "hf_Zq8Tn2Lr5Wv9Xc3Bm7Kd"):
        assert secret not in out
    assert "experiment: '***'" in out and "registered_model: '***'" in out and "account: '***'" in out
    assert "output_dir: /scratch/alice/x-***" in out and "output_dir: /scratch/alice/t" in out
    # and in an error line about the key it reached
    with pytest.raises(ConfigError) as err:
        resolve_recipe(KIMI, ["verifier.env.TOKEN=tiny", "tracking.experiment=${verifier.env.TOKEN}",
                              "tracking.registered_model='bad/${oc.env:DB_PASSWORD}'"])
    assert "opensesame" not in str(err.value) and "registered_model" in str(err.value)
