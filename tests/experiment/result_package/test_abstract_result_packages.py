"""The result-package interface: preparing, reading results, quality checks, and combining packages."""
import copy
import logging
import pickle
import zipfile

import numpy as np
import pytest
import torch
from sklearn import metrics

from aitoolbox.experiment.result_package import (
    AbstractResultPackage,
    MultipleResultPackageWrapper,
    PreCalculatedResultPackage,
)
from aitoolbox.experiment.result_package.basic_packages import (
    ClassificationResultPackage,
    GeneralResultPackage,
    RegressionResultPackage,
)
from aitoolbox.experiment.training_history import TrainingHistory


class FixedResults(AbstractResultPackage):
    """Returns the given results whatever the data; records what the metrics were handed."""

    def __init__(self, results, pkg_name="Fixed", **kwargs):
        super().__init__(pkg_name, **kwargs)
        self.fixed = results

    def prepare_results_dict(self):
        return dict(self.fixed)


def prepared(results, pkg_name="Fixed", hyperparameters=None, y_true=(1, 2), y_predicted=(1, 3)):
    package = FixedResults(results, pkg_name)
    return package.prepare_result_package(list(y_true), list(y_predicted), hyperparameters)


@pytest.fixture
def warnings_log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("aitoolbox"), "propagate", True)
    caplog.set_level(logging.WARNING)
    return caplog


# --- preparing and reading --------------------------------------------------------------------------------
def test_prepare_keeps_data_hyperparameters_history_and_additional_results():
    history = TrainingHistory()
    package = FixedResults({"m": 1.0})
    returned = package.prepare_result_package(torch.tensor([1, 2]), [3, 4], {"lr": 0.1},
                                              additional_results={"ids": [7, 8]}, training_history=history, note="x")
    assert returned is package
    assert isinstance(package.y_true, np.ndarray) and package.y_predicted.tolist() == [3, 4]
    assert package.hyperparameters == {"lr": 0.1} and package.training_history is history
    # As in aitoolbox 1.x: the prediction metadata is under 'additional_results', other keywords beside it.
    assert package.additional_results == {"additional_results": {"ids": [7, 8]}, "note": "x"}


def test_get_results_before_prepare_warns_or_raises_when_strict(warnings_log):
    assert FixedResults({"m": 1.0}).get_results() is None
    assert "prepare_result_package" in warnings_log.text
    with pytest.raises(ValueError, match="prepare_result_package"):
        FixedResults({"m": 1.0}, strict_content_check=True).get_results()


def test_get_results_returns_a_copy():
    package = prepared({"Accuracy": 0.5})
    package.get_results()["Accuracy"] = 99.0
    assert package.get_results() == {"Accuracy": 0.5}


def test_reading_an_unprepared_package_is_a_clear_error():
    package = FixedResults({"m": 1.0})
    for read in (str, len, lambda p: "m" in p, lambda p: p["m"]):
        with pytest.raises(ValueError, match="no results yet"):
            read(package)


def test_str_len_contains_getitem():
    package = prepared({"Accuracy": 0.5, "F1": 0.25})
    assert str(package) == "Accuracy: 0.5\nF1: 0.25"
    assert len(package) == 2 and "F1" in package and "Missing" not in package
    assert package["F1"] == 0.25
    with pytest.raises(KeyError, match="Missing"):
        package["Missing"]


def test_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="4 samples.*3"):
        ClassificationResultPackage().prepare_result_package([0, 1, 1, 0], [0, 1, 1])


def test_prepare_results_dict_must_return_a_dict():
    class ReturnsNumber(AbstractResultPackage):
        def prepare_results_dict(self):
            return 0.5

    with pytest.raises(TypeError, match="must return a dict"):
        ReturnsNumber("n").prepare_result_package([1], [1])
    with pytest.raises(TypeError):
        AbstractResultPackage("abstract")  # prepare_results_dict is abstract


def test_np_array_options():
    tokens_true, tokens_pred = [[1, 2, 3], [4]], [[1, 2], [4, 5]]
    kept = FixedResults({}, np_array=False).prepare_result_package(tokens_true, tokens_pred)
    assert kept.y_true is tokens_true
    auto = FixedResults({}, np_array="auto").prepare_result_package(tokens_true, [[1, 2], [4, 5]])
    assert auto.y_true is tokens_true and isinstance(auto.y_predicted, np.ndarray)  # ragged stays a list
    with pytest.raises(ValueError, match="np_array=False"):
        FixedResults({}).prepare_result_package(tokens_true, tokens_pred)
    with pytest.raises(ValueError, match="np_array must be one of"):
        FixedResults({}, np_array="yes")
    assert FixedResults({}, extra=3).package_metadata == {"extra": 3}
    assert FixedResults({}, pkg_name=None).pkg_name is None


def test_non_finite_results_warn_or_raise_when_strict(warnings_log):
    package = FixedResults({"m": float("nan")})
    assert np.isnan(package.prepare_result_package([1], [1]).get_results()["m"])
    assert "not finite" in warnings_log.text
    with pytest.raises(ValueError, match="not finite"):
        FixedResults({"m": float("inf")}, strict_content_check=True).prepare_result_package([1], [1])


# --- quality checks -----------------------------------------------------------------------------------------
def test_hyperparameter_checks(warnings_log):
    complete = {"bash_script_path": "run.sh", "experiment_file_path": "train.py"}
    assert prepared({}, hyperparameters=complete).get_hyperparameters() == complete
    assert warnings_log.text == ""
    assert prepared({}, hyperparameters={"lr": 0.1}).get_hyperparameters() == {"lr": 0.1}
    assert "bash_script_path" in warnings_log.text and "experiment_file_path" in warnings_log.text
    assert FixedResults({}).get_hyperparameters() is None  # none given: a warning, not a crash
    strict = FixedResults({}, strict_content_check=True)
    with pytest.raises(ValueError, match="hyperparameters are missing"):
        strict.get_hyperparameters()
    strict.prepare_result_package([1], [1], {"lr": 0.1})
    with pytest.raises(ValueError, match="bash_script_path"):
        strict.get_hyperparameters()


class WithDumpPaths(FixedResults):
    def __init__(self, paths):
        super().__init__({"m": 1.0})
        self.paths = paths

    def list_additional_results_dump_paths(self):
        return self.paths


@pytest.mark.parametrize("paths", [None, [], [["a.txt", "/tmp/a.txt"], ["b.png", "/tmp/b.png"]]])
def test_additional_results_dump_paths(paths):
    package = WithDumpPaths(paths)
    assert package.get_additional_results_dump_paths() == paths
    assert package.additional_results_dump_paths == paths


@pytest.mark.parametrize("paths", ["/tmp/a.txt", ["/tmp/a.txt"], [["a.txt"]], [["a.txt", 3]],
                                   [["a.txt", "/tmp/a.txt"], "b"], [("a.txt", "/tmp/a.txt")]])
def test_malformed_dump_paths_are_rejected(paths):
    with pytest.raises(ValueError, match="file name, path"):
        WithDumpPaths(paths).get_additional_results_dump_paths()


def test_zip_additional_results_dump(tmp_path):
    source = tmp_path / "heatmaps"
    source.mkdir()
    (source / "one.txt").write_text("1")
    for target in (tmp_path / "out", tmp_path / "out2.zip"):
        zip_path = AbstractResultPackage.zip_additional_results_dump(str(source), str(target))
        assert zip_path == str(target).removesuffix(".zip") + ".zip"
        assert zipfile.ZipFile(zip_path).namelist() == ["one.txt"]


def test_package_survives_deepcopy_and_pickle():
    package = ClassificationResultPackage().prepare_result_package([1, 0], [1, 1], training_history=TrainingHistory())
    for clone in (copy.deepcopy(package), pickle.loads(pickle.dumps(package))):
        assert clone.get_results() == package.get_results()
        assert clone.get_results()["Accuracy"] == 0.5


# --- combining: + -----------------------------------------------------------------------------------------
def test_adding_packages_nests_results_by_package_name():
    first = prepared({"a": 1.0}, "First", hyperparameters={"lr": 0.1}, y_true=(1, 2))
    second = prepared({"b": 2.0}, "Second", hyperparameters={"lr": 9.9}, y_true=(3, 4))
    combined = first + second
    assert isinstance(combined, MultipleResultPackageWrapper)
    assert combined.get_results() == {"First": {"a": 1.0}, "Second": {"b": 2.0}}
    assert combined.hyperparameters == {"lr": 0.1}  # the left operand's
    assert combined.y_true["Second"].tolist() == [3, 4]
    assert len(combined) == 2
    assert str(combined) == "--> First:\na: 1.0\n--> Second:\nb: 2.0"
    # The wrapper holds copies: the operands stay as they were.
    assert combined.result_packages[0] is not first and combined.result_packages[0].get_results() == {"a": 1.0}


def test_same_names_get_the_position_appended():
    packages = [prepared({"m": float(i)}, name) for i, name in enumerate(["P", "P", "Other", "P"])]
    combined = sum(packages)  # sum() starts from 0, which adds nothing
    assert list(combined.get_results()) == ["P", "P1", "Other", "P3"]
    tricky = prepared({}, "A") + prepared({}, "A2") + prepared({}, "A")
    assert list(tricky.get_results()) == ["A", "A2", "A2_"]  # never overwrites a result
    unnamed = prepared({"x": 1.0}, None) + prepared({"y": 2.0}, None)
    assert unnamed.get_results() == {"ResultPackage0": {"x": 1.0}, "ResultPackage1": {"y": 2.0}}


def test_adding_a_results_dict_wraps_it():
    package = prepared({"a": 1.0})
    for combined in (package + {"b": 2.0}, {"b": 2.0} + package):
        assert combined.get_results() == {"Fixed": {"a": 1.0}, "PreCalculatedResult": {"b": 2.0}}
        pre = combined.result_packages[1]
        assert isinstance(pre, PreCalculatedResultPackage) and pre.get_hyperparameters() == {}
        assert isinstance(pre.training_history, TrainingHistory)


def test_adding_wrappers_flattens_them():
    wrapper = prepared({"a": 1.0}, "A") + prepared({"b": 2.0}, "B")
    longer = wrapper + prepared({"c": 3.0}, "C")
    assert [p.pkg_name for p in longer.result_packages] == ["A", "B", "C"]
    assert longer is not wrapper and len(wrapper) == 2
    front = prepared({"z": 0.0}, "Z") + wrapper
    assert [p.pkg_name for p in front.result_packages] == ["Z", "A", "B"]
    both = wrapper + wrapper
    assert list(both.get_results()) == ["A", "B", "A2", "B3"]


@pytest.mark.parametrize("other", [2233, [1.0], "Accuracy", None])
def test_adding_something_else_is_a_value_error(other):
    with pytest.raises(ValueError, match="result package or a dict"):
        prepared({"a": 1.0}) + other
    with pytest.raises(ValueError, match="result package or a dict"):
        (prepared({"a": 1.0}) + prepared({"b": 1.0}, "B")) + other


def test_adding_unprepared_packages_is_a_value_error():
    with pytest.raises(ValueError, match="no results yet"):
        FixedResults({"a": 1.0}) + prepared({"b": 1.0})
    with pytest.raises(ValueError, match="no results yet"):
        prepared({"b": 1.0}) + FixedResults({"a": 1.0})
    with pytest.raises(ValueError, match="no results yet"):
        {"b": 1.0} + FixedResults({"a": 1.0})


# --- combining: += ----------------------------------------------------------------------------------------
def test_in_place_addition_merges_metrics_into_the_package():
    package = prepared({"a": 1.0}, hyperparameters={"lr": 0.1})
    same = package
    package += prepared({"b": 2.0}, "Other")
    package += {"c": 3.0}
    assert package is same and type(package) is FixedResults
    assert package.get_results() == {"a": 1.0, "b": 2.0, "c": 3.0}
    assert package.get_hyperparameters() == {"lr": 0.1}


def test_in_place_addition_errors_change_nothing():
    package = prepared({"a": 1.0, "b": 2.0})
    with pytest.raises(ValueError, match=r"\['b'\] are in both"):
        package += {"b": 5.0, "c": 1.0}
    with pytest.raises(ValueError, match="result package or a dict"):
        package += 3
    with pytest.raises(ValueError, match="no results yet"):
        package += FixedResults({"z": 1.0})
    assert package.get_results() == {"a": 1.0, "b": 2.0}


def test_in_place_addition_to_a_wrapper_appends_packages():
    wrapper = MultipleResultPackageWrapper()
    assert wrapper.prepare_result_package([prepared({"a": 1.0}, "A"), prepared({"b": 2.0}, "B")]) is wrapper
    same = wrapper
    wrapper += prepared({"c": 3.0}, "A")
    wrapper += {"d": 4.0}
    wrapper += {"d": 4.0}
    assert wrapper is same
    assert wrapper.get_results() == {"A": {"a": 1.0}, "B": {"b": 2.0}, "A2": {"c": 3.0},
                                     "PreCalculatedResult": {"d": 4.0}, "PreCalculatedResult4": {"d": 4.0}}


# --- the wrapper -----------------------------------------------------------------------------------------------
def test_wrapper_dump_paths_collect_every_package():
    first, second = WithDumpPaths([["a", "/a"]]), WithDumpPaths([["b", "/b"]])
    for package in (first, second):
        package.prepare_result_package([1], [1])
    wrapper = MultipleResultPackageWrapper().prepare_result_package([first, second, prepared({})])
    assert wrapper.get_additional_results_dump_paths() == [["a", "/a"], ["b", "/b"]]
    assert MultipleResultPackageWrapper().prepare_result_package([prepared({})]) \
        .get_additional_results_dump_paths() is None


def test_wrapper_prepared_on_data_prepares_every_package():
    """A combination handed to an evaluation callback is prepared with each new evaluation's data."""
    y_first, y_second = np.array([0.0, 1.0, 2.0]), np.array([1.0, 1.0, 2.5])
    regression = RegressionResultPackage().prepare_result_package(y_first, y_first)
    general = GeneralResultPackage([metrics.max_error]).prepare_result_package(y_first, y_first)
    combined = (regression + general) + {"epoch": 3}
    assert combined.prepare_result_package(y_first, y_second, hyperparameters={"lr": 0.1}) is combined
    assert combined.get_results() == {
        "RegressionResult": {"Mean_squared_error": metrics.mean_squared_error(y_first, y_second),
                             "Mean_absolute_error": metrics.mean_absolute_error(y_first, y_second)},
        "GeneralResultPackage": {"max_error": metrics.max_error(y_first, y_second)},
        "PreCalculatedResult": {"epoch": 3},  # pre-calculated results stay
    }
    assert combined.hyperparameters == {"lr": 0.1} and combined.y_predicted["RegressionResult"].tolist() == [1, 1, 2.5]
    assert regression.get_results()["Mean_squared_error"] == 0.0  # the operands were copied
    with pytest.raises(ValueError, match="holds no result packages"):
        MultipleResultPackageWrapper().prepare_result_package(y_first, y_second)


class SpanCountPackage(AbstractResultPackage):
    """A QA-style package: its targets are placeholders, the references come with the metadata."""

    def __init__(self):
        super().__init__("SpanCountPackage", False, np_array=False)

    def prepare_results_dict(self):
        return {"n_predictions": len(self.y_predicted),
                "n_references": len(self.additional_results["additional_results"]["references"])}


def test_a_custom_package_may_take_placeholder_targets_while_the_metric_packages_check_alignment():
    package = SpanCountPackage()
    package.prepare_result_package(torch.tensor([0, 0]), torch.zeros(12, 5, 2),
                                   additional_results={"references": ["a"] * 12})
    assert package.get_results() == {"n_predictions": 12, "n_references": 12}
    with pytest.raises(ValueError, match="y_true has 2 samples but y_predicted has 12"):
        ClassificationResultPackage().prepare_result_package(torch.tensor([0, 1]), torch.zeros(12))
