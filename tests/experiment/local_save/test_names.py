"""Project, experiment and timestamp names are checked in one place for every folder and key they build."""
import os
import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn
from torch.utils.data import DataLoader

from aitoolbox.cloud.layout import ExperimentKeys, newest_cloud_run
from aitoolbox.experiment.local_save.experiment_folder import ExperimentFolder, newest_resumable_run
from aitoolbox.experiment.local_save.folder_create import ExperimentFolder as FolderCreate
from aitoolbox.experiment.local_save.names import check_key_prefix, check_name, check_relative_path
from aitoolbox.torchtrain.callbacks.model_load import ModelLoadContinueTraining
from aitoolbox.torchtrain.train_loop import TrainLoop, TrainLoopCheckpoint
from tests.helpers import MLP, classification_data

BAD_NAMES = ["a/b", "../escape", "..", ".", "a\\b", "line\nbreak", "nul\x00", "",
             # issue 31 item 10: the C1 controls (NEL among them), line and paragraph separators, a lone surrogate,
             # non-characters, bidi overrides, and a name longer than a file system takes
             "next\x85line", "csi\x9b", "line\u2028sep", "para\u2029sep", "lone\ud800", "non\ufffe", "non\U0001ffff",
             "non\ufdd0", "evil\u202egnp.exe", "iso\u2066late", "x" * 256, "é" * 128,
             # issue 31 review: invisible and look-alike characters (format, private use, not NFKC-stable)
             "zero\u200bwidth", "\ufeffbom", "soft\u00adhyphen", "joined\u200d", "private\ue000",
             "team\uff0fexp", "\uff45xp", "\ufb01le", "re\u0301sume\u0301", "x\u00b2"]
GOOD_NAMES = ["my project", "exp.v2", "résumé-run_1", "2024-01-02_03-04-05", " padded ", "a..b"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_every_place_that_builds_a_path_or_key_refuses_a_bad_name_naming_it(tmp_path, bad):
    escaped = re.escape(repr(bad))
    with pytest.raises(ValueError, match=f"project_name(={escaped} cannot name| must be a non-empty)"):
        ExperimentFolder(str(tmp_path), bad, "exp")
    if bad:  # an empty timestamp means "now", as before
        with pytest.raises(ValueError, match=f"timestamp={escaped}"):
            ExperimentFolder(str(tmp_path), "proj", "exp", timestamp=bad)
    with pytest.raises(ValueError, match=f"experiment_name(={escaped}| must be)"):
        FolderCreate.create_base_folder("proj", bad, "ts", str(tmp_path))
    with pytest.raises(ValueError, match=f"experiment_timestamp(={escaped}| must be)"):
        FolderCreate.get_base_folder_paths("proj", "exp", bad, str(tmp_path))
    with pytest.raises(ValueError, match=f"project_name(={escaped}| must be)"):
        ExperimentKeys("team", bad, "exp", "ts")
    with pytest.raises(ValueError, match=f"experiment_timestamp(={escaped}| must be)"):
        ExperimentKeys("team", "proj", "exp", bad)
    with pytest.raises(ValueError, match=f"experiment_name(={escaped}| must be)"):
        newest_resumable_run(str(tmp_path), "proj", bad)
    with pytest.raises(ValueError, match=f"project_name(={escaped}| must be)"):
        newest_cloud_run(None, "team", bad, "exp")  # refused before the bucket is asked
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_the_message_says_what_is_allowed():
    with pytest.raises(ValueError) as refused:
        check_name("a/b", "experiment_name")
    assert str(refused.value).startswith("experiment_name='a/b' cannot name a folder or a bucket key: it must be a "
                                         "plain name: any text except '/'")


@pytest.mark.parametrize("good", GOOD_NAMES)
def test_names_aitoolbox_1_allowed_keep_working(tmp_path, good):
    folder = ExperimentFolder(str(tmp_path), good, good, timestamp=good)
    assert folder.create() == str(tmp_path / good / f"{good}_{good}")
    assert FolderCreate.create_base_folder(good, good, good, str(tmp_path)) == folder.path
    assert ExperimentKeys("team", good, good, good).experiment == f"team/{good}/{good}_{good}"


def test_a_training_preset_and_the_load_callback_refuse_bad_names(tmp_path):
    model = MLP()
    arguments = (model, DataLoader(classification_data(8), batch_size=4), None, None,
                 torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="project_name='team/proj'"):
        TrainLoopCheckpoint(*arguments, "team/proj", "exp", str(tmp_path), {}, show_progress=False)
    loop = TrainLoop(*arguments, show_progress=False)
    callback = ModelLoadContinueTraining("../../2024", project_name="proj", experiment_name="exp",
                                         local_model_result_folder_path=str(tmp_path))
    with pytest.raises(ValueError, match=re.escape("saved_experiment_timestamp='../../2024'")):
        loop.callbacks_handler.register_callbacks([callback])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("prefix, ok", [("", True), (None, True), ("team", True), ("team/sub/", True),
                                        ("/abs/team", True), ("team/../other", False), ("..", False),
                                        ("./team", False), ("team\n", False)])
def test_a_cloud_prefix_may_have_folders_but_never_climb_out(prefix, ok):
    if ok:
        assert check_key_prefix(prefix) == (prefix or "")
        ExperimentKeys(prefix, "proj", "exp", "ts")
    else:
        with pytest.raises(ValueError, match="cloud_dir_prefix="):
            ExperimentKeys(prefix, "proj", "exp", "ts")


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "C:/x", "a\\..\\x", "a//b", "./a", "", "a/"])
def test_paths_read_from_storage_must_stay_inside(path):
    with pytest.raises(ValueError, match="refused because"):
        check_relative_path(path, "the marker")


def test_paths_read_from_storage_may_have_folders():
    assert check_relative_path("shard/__0_0.distcp", "the marker") == "shard/__0_0.distcp"
    assert check_relative_path("..hidden/.metadata", "the marker") == "..hidden/.metadata"


# --- issue 31 item 10: every character a name could carry that would fail later ---------------------------------
def test_the_message_names_the_character_and_where_it_is():
    with pytest.raises(ValueError) as refused:
        check_name("run\u2028two", "experiment_name")
    assert "U+2028 (LINE SEPARATOR) at position 3" in str(refused.value)
    with pytest.raises(ValueError, match="U\\+D800 \\(a lone surrogate\\)"):
        check_name("x\ud800", "project_name")
    with pytest.raises(ValueError, match="256 bytes in UTF-8; a file system takes at most 255"):
        check_name("x" * 256, "project_name")


ANY_CHARACTER = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=())


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=ANY_CHARACTER, max_size=12))
def test_a_name_that_passes_works_everywhere_a_name_goes(tmp_path_factory, name):
    try:
        check_name(name, "experiment_name")
    except ValueError as error:
        assert repr(name) in str(error) or "must be a non-empty string" in str(error)
        return
    encoded = name.encode("utf-8")  # a key, a header, a log line: never a UnicodeEncodeError
    assert 0 < len(encoded) <= 255
    # (a zero-width joiner or non-joiner only between characters that join: see the next tests)
    assert not any(unicodedata.category(char) in ("Cc", "Cf", "Co", "Cs", "Zl", "Zp") and char not in "\u200c\u200d"
                   for char in name)
    assert unicodedata.normalize("NFKC", name) == name
    assert name.splitlines() == [name] and name not in (".", "..")
    folder = tmp_path_factory.mktemp("names")
    os.mkdir(os.path.join(str(folder), name))  # one folder, inside the root
    assert os.listdir(str(folder)) == [name]
    assert check_relative_path(name, "a marker") == name and check_key_prefix(f"team/{name}") == f"team/{name}"


@pytest.mark.parametrize("name, described", [
    ("a\u200bb", "U+200B (ZERO WIDTH SPACE) at position 1"),
    ("\ufeffrun", "U+FEFF (ZERO WIDTH NO-BREAK SPACE) at position 0"),
    ("run\ue000", "U+E000 (a private-use character) at position 3"),
    ("team\uff0fexp", "U+FF0F (FULLWIDTH SOLIDUS) at position 4, which NFKC normalization writes as '/'"),
    ("re\u0301", "U+0065 (LATIN SMALL LETTER E) U+0301 (COMBINING ACUTE ACCENT) at position 1, which NFKC "
                 "normalization writes as 'é'"),
])
def test_invisible_and_look_alike_characters_are_refused_naming_the_code_point(name, described):
    with pytest.raises(ValueError) as refused:
        check_name(name, "experiment_name")
    assert f"it holds {described}" in str(refused.value) and repr(name) in str(refused.value)
    with pytest.raises(ValueError, match=re.escape(described.split(" at position")[0])):
        check_key_prefix(f"team/{name}")


@pytest.mark.parametrize("bad", ["team/\x85", "team/\u2028x", "\ud800", "a/\u202e", "a/\u200b", "a/\ue000"])
def test_prefixes_and_paths_read_from_storage_refuse_the_same_characters(bad):
    with pytest.raises(ValueError):
        check_key_prefix(bad)
    with pytest.raises(ValueError):
        check_relative_path(bad, "s3://bucket/marker")


# --- second review of issue 31: invisible characters of other categories, look-alikes, words that join ------------
@pytest.mark.parametrize("name, described", [
    ("run\u034f1", "U+034F (COMBINING GRAPHEME JOINER) at position 3"),
    ("run1\ufe00", "U+FE00 (VARIATION SELECTOR-1) at position 4"),
    ("run\u115f1", "U+115F (HANGUL CHOSEONG FILLER) at position 3"),
    ("run\u28001", "U+2800 (BRAILLE PATTERN BLANK) at position 3"),
    ("team\u2215exp", "U+2215 (DIVISION SLASH) at position 4, which looks like a path separator"),
    ("team\u2044exp", "U+2044 (FRACTION SLASH) at position 4, which looks like a path separator"),
    ("r\u0430n", "U+0430 (CYRILLIC SMALL LETTER A) at position 1 in the Latin word 'r\u0430n'"),
    ("ab\u200dc", "U+200D (ZERO WIDTH JOINER) at position 2"),  # no job between Latin letters
])
def test_other_invisible_and_look_alike_characters_are_refused(name, described):
    with pytest.raises(ValueError) as refused:
        check_name(name, "experiment_name")
    assert described in str(refused.value)
    with pytest.raises(ValueError, match=re.escape(described.split(" at position")[0])):
        check_key_prefix(f"team/{name}")


@pytest.mark.parametrize("name", ["\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",  # Persian, with ZWNJ
                                  "\U0001f469\u200d\U0001f52c-runs",  # an emoji ZWJ sequence
                                  "\u2764\ufe0f\u200d\U0001f525", "1\ufe0f\u20e3-run",  # emoji with selectors
                                  "\u03b1_sweep", "\u03bcP_sweep", "\u03b2eta", "\u043e\u043f\u044b\u0442",
                                  "\u65e5\u672c\u8a9e", "\u00dcn\u00efc\u00f6d\u00e9"])
def test_words_that_need_a_joiner_and_words_of_one_script_are_taken(name):
    assert check_name(name, "experiment_name") == name


@pytest.mark.parametrize("written, suggested", [
    (unicodedata.normalize("NFD", "Caf\u00e9"), "Caf\u00e9"),  # as macOS's HFS+ lists it
    (unicodedata.normalize("NFD", "\uc2e4\ud5d8"), "\uc2e4\ud5d8"),  # Hangul in jamo
    ("\u00b5P_sweep", "\u03bcP_sweep"),  # MICRO SIGN, as a Mac keyboard types it
])
def test_a_name_nfkc_changes_is_refused_with_the_form_to_use(written, suggested):
    with pytest.raises(ValueError) as refused:
        check_name(written, "project_name")
    assert f"(the whole name so written: {suggested!r}; use that)" in str(refused.value)
    assert check_name(suggested, "project_name") == suggested
