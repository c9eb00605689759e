"""The Slurm path's pure parts, in seconds: Determined's hyperparameter space as Optuna suggestions,
and the job shapes a trial's ``resources`` become. The daemons' tests are in test_slurm_run.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from det_lab.slurm.job import JobSpec, trial_command
from det_lab.slurm.search import SearchConfigError, check_searcher, suggest

TEMPLATES = Path(__file__).resolve().parents[1] / "experiment_templates"

SPACE = {
    "const_plain": 3,
    "const_typed": {"type": "const", "val": "adamw"},
    "layers": {"type": "int", "minval": 2, "maxval": 6},
    "dropout": {"type": "double", "minval": 0.0, "maxval": 0.5},
    "lr": {"type": "log", "base": 10, "minval": -4, "maxval": -2},
    "width": {"type": "log", "base": 2, "minval": 4, "maxval": 8},
    "act": {"type": "categorical", "vals": ["relu", "gelu"]},
    "shape": {"type": "categorical", "vals": [[1, 2], {"a": 1}]},
    "model": {"encoder": {"depth": {"type": "int", "minval": 1, "maxval": 3}, "kind": "cnn"}},
}


def _sample(space: dict, n: int = 40) -> tuple[list[dict], optuna.Study]:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append(suggest(trial, space))
        study.tell(trial, 0.0)
    return out, study


def test_every_hyperparameter_type_becomes_the_matching_suggestion():
    samples, study = _sample(SPACE)
    for hp in samples:
        assert hp["const_plain"] == 3 and hp["const_typed"] == "adamw"
        assert isinstance(hp["layers"], int) and 2 <= hp["layers"] <= 6
        assert isinstance(hp["dropout"], float) and 0.0 <= hp["dropout"] <= 0.5
        assert 1e-4 <= hp["lr"] <= 1e-2 and 2 ** 4 <= hp["width"] <= 2 ** 8
        assert hp["act"] in ("relu", "gelu") and hp["shape"] in ([1, 2], {"a": 1})
        assert hp["model"]["encoder"] == {"depth": hp["model"]["encoder"]["depth"], "kind": "cnn"}
        assert 1 <= hp["model"]["encoder"]["depth"] <= 3
    # log spaces are sampled on a log scale: both decades of lr get draws
    assert {math.floor(math.log10(hp["lr"])) for hp in samples} == {-4, -3}
    # nested names are dotted, non-scalar categoricals are picked by index: what the study shows
    names = set(study.trials[0].params)
    assert names == {"layers", "dropout", "lr", "width", "act", "shape.index", "model.encoder.depth"}
    assert {hp["act"] for hp in samples} == {"relu", "gelu"}


def test_the_shipped_search_config_translates():
    conf = yaml.safe_load((TEMPLATES / "vla" / "search.yaml").read_text())
    check_searcher(conf, "search.yaml")
    samples, _ = _sample(conf["hyperparameters"], 10)
    for hp in samples:
        assert 10 ** -3.7 <= hp["lr"] <= 10 ** -2.3
        assert hp["model"]["d_model"] in (64, 128, 256) and 2 <= hp["model"]["n_layers"] <= 6


@pytest.mark.parametrize("spec, message", [
    ({"type": "int", "minval": 5, "maxval": 1}, "hyperparameters.x: int needs minval <= maxval"),
    ({"type": "log", "minval": -3}, "hyperparameters.x: log needs minval <= maxval"),
    ({"type": "categorical", "vals": []}, "hyperparameters.x: categorical needs a non-empty vals list"),
    ({"type": "uniform", "minval": 0, "maxval": 1}, "hyperparameters.x: unknown hyperparameter type 'uniform'"),
])
def test_a_space_optuna_cannot_sample_is_refused_in_one_line(spec, message):
    conf = {"searcher": {"name": "random", "metric": "val_loss", "max_trials": 2}, "hyperparameters": {"x": spec}}
    with pytest.raises(SearchConfigError) as err:
        check_searcher(conf, "c.yaml")
    assert str(err.value) == f"c.yaml: {message}"


def test_resources_become_job_shapes():
    cpu = JobSpec("t", "o", nodes=1, gpus_per_node=0).header()
    assert not any("--gres" in line for line in cpu)  # slots_per_trial: 0 asks for no GPU
    one = JobSpec("t", "o", nodes=1, gpus_per_node=2)
    assert "#SBATCH --gres=gpu:2" in one.header() and "#SBATCH --nodes=1" in one.header()
    assert not one.launcher(["-m", "x"]).startswith("srun")
    many = JobSpec("t", "o", nodes=2, gpus_per_node=4)
    assert {"#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --ntasks-per-node=1"} <= set(many.header())
    assert many.launcher(["-m", "x"]).startswith("srun --ntasks-per-node=1")  # one driver per node

    command = [sys.executable, "-m", "trial"]
    assert trial_command(command, 1, 1, {}) == command
    assert trial_command(command, 0, 1, {}) == command
    assert trial_command(command, 2, 1, {}) == [sys.executable, "-m", "torch.distributed.run",
                                                "--nproc_per_node=2", "--standalone", "-m", "trial"]
    # several nodes: torchrun's static rendezvous at the first node, ranks in Slurm's node order
    # (c10d would ignore --node_rank and give out ranks as the nodes arrive)
    assert trial_command(command, 2, 2, {"SLURM_NODEID": "1"}, head="10.0.0.1") == [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=2", "--node_rank=1",
        "--rdzv_backend=static", "--master_addr=10.0.0.1", "--master_port=29500", "-m", "trial"]
