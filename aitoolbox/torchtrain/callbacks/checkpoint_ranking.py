"""How a ranking :class:`~aitoolbox.torchtrain.callbacks.model_save.ModelCheckpoint` keeps to itself, and what it
remembers across processes.

* **Its own files.** Several epoch-checkpoint callbacks may write into one checkpoint folder (Lightning users
  register one ``ModelCheckpoint`` per metric). The first keeps aitoolbox 1.8's names,
  ``model_<experiment>_<timestamp>_E<n>.pth`` and the ranking record ``.aitoolbox-checkpoint-ranking.json``; each
  later one tags its checkpoint names and its record with its metric
  (``model_<experiment>_<timestamp>_<metric>_E<n>.pth``), so that no callback prunes, overwrites or ranks another's
  checkpoints.
* **Its ranking in its state.** The ``(score, path)`` of the checkpoints it ranked travel in every checkpoint (the
  callbacks' states), so a run continued from a checkpoint in another run folder (``load_checkpoint`` in a new
  process) still knows the best checkpoint of the earlier folder. Only checkpoints of its current folder are ever
  deleted: the earlier folder's files stay as they are.
"""
import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aitoolbox.experiment.local_save.checkpoints import checkpoint_file_name

RANKING_MODES = ("auto", "min", "max")
# The tag of a later callback that ranks nothing (rm_subopt_local_models=False): it keeps every epoch.
EVERY_EPOCH_TAG = "every_epoch"

Ranking = List[Tuple[float, str]]


def check_ranking_mode(mode: Any, rm_subopt_local_models: Any) -> None:
    """Raise ``ValueError`` for a ``mode`` that is not one of :data:`RANKING_MODES`, or that is given without a
    ranking."""
    if not isinstance(mode, str) or mode not in RANKING_MODES:
        raise ValueError(f"mode must be one of {RANKING_MODES}, got {mode!r}")
    if mode != "auto" and rm_subopt_local_models is False:
        raise ValueError(f"mode={mode!r} sets which way rm_subopt_local_models's metric ranks the checkpoints, and "
                         "rm_subopt_local_models=False ranks none: pass rm_subopt_local_models=True (val_loss) or a "
                         "metric name, or leave mode='auto'")


def higher_is_better(metric_name: str, mode: str = "auto") -> bool:
    """``mode='max'``: True, ``'min'``: False; ``'auto'`` (aitoolbox 1.x's guess): True unless the metric's name
    contains 'loss' or 'error'."""
    if mode != "auto":
        return mode == "max"
    name = metric_name.lower()
    return not ("loss" in name or "error" in name)


def _tag_text(callback: Any) -> str:
    ranked = callback.rm_subopt_local_models
    if ranked is False:
        return EVERY_EPOCH_TAG
    metric = ranked if isinstance(ranked, str) else callback.monitored_metric()
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", metric).strip("-.") or "metric"


def _settings(callback: Any) -> tuple:
    """What decides which files a saver writes and keeps: two savers alike (the same callback passed to every ``fit``
    call, as aitoolbox 1.x scripts do) write the same files, as in 1.x, rather than a tagged copy each."""
    return (type(callback), _tag_text(callback), getattr(callback, "mode", None),
            getattr(callback, "num_best_checkpoints_kept", None))


def epoch_file_tag(callback: Any, savers: Sequence[Any]) -> Optional[str]:
    """The tag of ``callback``'s epoch checkpoint names and ranking record: None for the first of ``savers`` (the
    callbacks that save epoch checkpoints into its folder, in registration order), else its metric's name,
    numbered when an earlier callback took it (``val_loss``, ``val_loss_2``). A saver with the settings of an earlier
    one shares its tag (they write the same files)."""
    distinct: List[Any] = []
    for saver in savers:
        if not any(_settings(saver) == _settings(earlier) for earlier in distinct):
            distinct.append(saver)
        if saver is callback:
            break
    same = next((saver for saver in distinct if _settings(saver) == _settings(callback)), callback)
    position = next(index for index, saver in enumerate(distinct) if saver is same)
    if position == 0:
        return None
    texts = [_tag_text(saver) for saver in distinct[1:position + 1]]
    text, earlier = texts[-1], texts[:-1].count(texts[-1])
    return text if earlier == 0 else f"{text}_{earlier + 1}"


def epoch_file_name(folder: Any, epoch: int, tag: Optional[str]) -> str:
    """The epoch checkpoint's name: 1.8's ``model_<experiment>_<timestamp>_E<epoch>.pth``, with ``_<tag>`` before
    ``_E<epoch>`` when tagged (the name still reads as a checkpoint of that epoch for loading and ``auto_resume``)."""
    timestamp = folder.timestamp if tag is None else f"{folder.timestamp}_{tag}"
    return checkpoint_file_name(folder.experiment_name, timestamp, epoch)


def ranking_state(metric: Optional[str], mode: str, ranking: Ranking) -> Dict[str, Any]:
    """What a ranking callback keeps in checkpoints (plain data: a checkpoint loads with ``weights_only``)."""
    return {"metric": metric, "mode": mode, "checkpoints": [[float(score), path] for score, path in ranking]}


def ranking_from_state(state: Dict[str, Any], metric: str) -> Optional[Ranking]:
    """The ``(score, path)`` a :func:`ranking_state` holds, or None when it ranked another metric (or nothing)."""
    if not state or state.get("metric") != metric:
        return None
    entries = []
    for entry in state.get("checkpoints") or []:
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str):
            score = float(entry[0])
            entries.append((score, entry[1]))
    return entries


def merged(earlier: Ranking, later: Ranking) -> Ranking:
    """``earlier`` then ``later``, each path once (``later``'s score wins: a checkpoint written again is ranked by
    its new score)."""
    later_paths = {path for _, path in later}
    return [entry for entry in earlier if entry[1] not in later_paths] + list(later)


def elsewhere(ranking: Ranking, folder: str) -> List[str]:
    """The paths of ``ranking`` outside ``folder``: an earlier run folder's checkpoints, which are never deleted."""
    folder = os.path.abspath(folder)
    return [path for _, path in ranking if os.path.dirname(os.path.abspath(path)) != folder]


def after_pending_saves(ranking: Ranking, pending: Ranking, keep_best: int, folder: str,
                        higher_is_better: bool) -> Ranking:
    """The ranking as it stands once the saves of ``pending`` (in order) are complete and each has pruned: what a
    callback's state says whether its background saves have finished or not (a checkpoint written meanwhile must
    not depend on a writer thread's timing)."""
    for score, path in pending:
        ranking = merged(ranking, [(score, path)])
        ranked = sorted((entry for entry in ranking if not math.isnan(entry[0])), key=lambda entry: entry[0],
                        reverse=higher_is_better)
        keep = {entry_path for _, entry_path in ranked[:keep_best]} | {path} | set(elsewhere(ranking, folder))
        ranking = [entry for entry in ranking if entry[1] in keep]
    return ranking
