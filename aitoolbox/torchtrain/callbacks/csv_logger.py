"""CSV files of the training: a row per optimizer step (or every N batches) and a row per epoch.

Rows are appended and flushed one at a time, so a crash loses at most the row being written (a partial last
line is dropped when the file is read again); every rewrite of a file (a new column, a resume, the metrics
of the end of training) goes through a temporary file renamed over it, so readers never see half a file.
"""
import csv
import io
import json
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from aitoolbox.experiment.local_save.atomic import atomic_write_text
from aitoolbox.experiment.redaction import redact_hyperparams
from aitoolbox.torchtrain.callbacks.tracking_base import (
    PER_OPTIMIZER_STEP, BatchRecord, TrackingCallback, check_log_dir, describe_rollback)

logger = logging.getLogger(__name__)

#: The column that tells batch rows from epoch rows when both go into one file.
ROW_KIND_COLUMN = "row"


def _as_int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class CSVTable:
    """A CSV file that rows are appended to; its header grows when a row brings a new column.

    Args:
        path: the file; created with the first row (its folder must exist).
    """

    def __init__(self, path: str):
        self.path = path
        self.columns: List[str] = []
        self._handle: Optional[io.TextIOBase] = None
        self._writer: Any = None

    def read(self) -> Tuple[List[str], List[Dict[str, str]]]:
        """The header and the complete rows of the file (a partial last line, from a crash while it was written,
        is left out)."""
        if not os.path.isfile(self.path):
            return [], []
        with open(self.path, newline="", encoding="utf-8") as handle:
            text = handle.read()
        if not text.endswith("\n"):
            text = text[:text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text))
        rows = [row for row in reader if None not in row]  # more fields than the header: not a row of ours
        return list(reader.fieldnames or []), rows

    def open(self, keep: Callable[[Dict[str, str]], bool]) -> int:
        """Keep the rows of an existing file for which ``keep(row)`` is True, to append after them.

        Returns:
            How many rows were dropped.
        """
        self.close()
        self.columns, rows = self.read()
        kept = [row for row in rows if keep(row)]
        if os.path.isfile(self.path) and (len(kept) != len(rows) or not self._ends_cleanly()):
            self._rewrite(kept)
        return len(rows) - len(kept)

    def append(self, row: Dict[str, Any]) -> None:
        """Write one row and flush it (a new column first rewrites the file with the wider header)."""
        new_columns = [name for name in row if name not in self.columns]
        if new_columns:
            self.close()
            self.columns, rows = self.read()
            self.columns += [name for name in row if name not in self.columns]
            self._rewrite(rows)
        if self._handle is None:
            self._handle = open(self.path, "a", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._handle, fieldnames=self.columns, lineterminator="\n")
        self._writer.writerow({name: _cell(value) for name, value in row.items()})
        self._handle.flush()

    def merge_into_last(self, matches: Callable[[Dict[str, str]], bool], values: Dict[str, Any]) -> bool:
        """Add ``values`` to the last row for which ``matches(row)`` is True; False when there is none."""
        self.close()
        self.columns, rows = self.read()
        for row in reversed(rows):
            if matches(row):
                row.update({name: _cell(value) for name, value in values.items()})
                self.columns += [name for name in values if name not in self.columns]
                self._rewrite(rows)
                return True
        return False

    def close(self) -> None:
        handle, self._handle, self._writer = self._handle, None, None
        if handle is not None:
            handle.close()

    def _ends_cleanly(self) -> bool:
        with open(self.path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return True
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) == b"\n"

    def _rewrite(self, rows: Iterable[Dict[str, Any]]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.path, text.getvalue())


def _cell(value: Any) -> Any:
    # repr of a float is the shortest text that reads back as the same float.
    return repr(value) if isinstance(value, float) else value


class CSVLogger(TrackingCallback):
    """Write the training to CSV files, from the main process only.

    Files, in ``log_dir``:

    - ``batch_file_name`` (``batch_log.csv``): one row per optimizer step (``batch_log_frequency='step'``, the
      default) or every N batches, with the columns ``epoch``, ``iteration`` (the batch within the epoch),
      ``total_iteration`` (counted over the whole training), ``loss`` (the batch's), ``accumulated_loss`` (the
      epoch's mean so far) and ``lr_optimizer_<i>_group_<j>`` per parameter group; with a MultiLoss
      ``loss_<name>`` and ``accumulated_loss_<name>`` per loss;
    - ``epoch_file_name`` (``epoch_log.csv``): one row per epoch, ``epoch``, ``total_iteration`` and the history
      metrics that got a value in that epoch; the metrics of the end of training (``train_end_test_loss``) are
      added to the last epoch's row. With ``epoch_file_name=None`` these rows go into the batch file, told
      apart by the column ``row`` (``batch`` / ``epoch``);
    - ``run_info.json``: the hyperparameters and, once training ended, ``final_model_path`` (when
      ``ModelTrainEndSave`` or an EndSave preset saved the final model).

    With a preset's ``cloud_save_mode`` (see :doc:`cloud_storage`) the files also go to the bucket, under the
    run's key like every file of the run folder, after every epoch and when ``fit`` ends or stops on an
    exception (the files that changed only, in the background). A ``log_dir`` outside the run folder stays local.

    Continuing: at the start of each ``fit`` the files keep only the rows of what the TrainLoop has already
    trained (batches up to its ``total_iteration_idx``, epochs before ``epochs_completed``), so a run resumed
    from a checkpoint, or continued after an exception, appends after the last row it keeps and no batch trained
    again appears twice. A new TrainLoop (nothing trained yet) therefore starts the files afresh. To continue
    in the files of another process's run, pass the same absolute ``log_dir``. When
    :class:`~aitoolbox.torchtrain.callbacks.SpikeRollback` returns the run to an earlier point, the rows after it are
    dropped the same way (the replay writes those batches again), and the first row written after the rollback gets
    the column ``event`` describing it: the files hold the run's final trajectory once, the rollback marked where
    it happened (the epoch rows' ``rollbacks`` column counts them).

    Args:
        log_dir: the folder of the files. With ``is_project=True``, None is ``csv_logs/`` in the experiment's run
            folder and a relative path lies in the run folder; an absolute path is used as it is. With
            ``is_project=False``, a path from the working directory (None: ``./csv_logs``).
        batch_file_name: the batch rows' file name.
        epoch_file_name: the epoch rows' file name; None puts them into the batch file.
        batch_log_frequency: ``'step'`` for a row per optimizer step (with gradient accumulation: per
            accumulation window), N for every N-th batch, None for no batch rows.
        metric_names: the history metrics of the epoch rows; None: all.
        hyperparams: written to ``run_info.json``; None takes the experiment-tracking TrainLoop's.
        log_learning_rates: add the learning-rate columns.
        is_project: place ``log_dir`` in the experiment folder (see ``log_dir``).
        project_name, experiment_name, local_model_result_folder_path: the experiment folder, or None to take the
            loop's.

    Raises:
        TypeError / ValueError: a bad argument.
        MissingExperimentDetailsError: at registration, a folder inside the experiment folder was asked for
            and the experiment details are unknown.
    """

    INFO_FILE_NAME = "run_info.json"

    def __init__(self, log_dir: Optional[str] = None, batch_file_name: str = "batch_log.csv",
                 epoch_file_name: Optional[str] = "epoch_log.csv", batch_log_frequency: Union[int, str, None] = "step",
                 metric_names: Optional[Sequence[str]] = None, hyperparams: Optional[dict] = None,
                 log_learning_rates: bool = True, is_project: bool = True, project_name: Optional[str] = None,
                 experiment_name: Optional[str] = None, local_model_result_folder_path: Optional[str] = None):
        super().__init__("CSV training log", metric_names, batch_log_frequency, hyperparams, project_name,
                         experiment_name, local_model_result_folder_path, log_learning_rates)
        for name, value in (("batch_file_name", batch_file_name), ("epoch_file_name", epoch_file_name)):
            if value is None and name == "epoch_file_name":
                continue
            if not isinstance(value, str) or not value or os.sep in value or value in (".", "..", self.INFO_FILE_NAME):
                raise ValueError(f"{name} must be a plain file name such as 'batch_log.csv', got {value!r}")
        self.log_dir = check_log_dir(log_dir, is_project)
        self.is_project = is_project
        self.batch_file_name = batch_file_name
        self.epoch_file_name = epoch_file_name if epoch_file_name != batch_file_name else None
        self.log_dir_path: Optional[str] = None  # resolved at registration
        self.batch_table: Optional[CSVTable] = None
        self.epoch_table: Optional[CSVTable] = None
        self._event: Optional[str] = None  # a rollback to note in the next row

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["batch_table"] = state["epoch_table"] = None  # open files do not travel to other processes
        return state

    @property
    def one_file(self) -> bool:
        return self.epoch_file_name is None

    @property
    def batch_file_path(self) -> Optional[str]:
        return os.path.join(self.log_dir_path, self.batch_file_name) if self.log_dir_path else None

    @property
    def epoch_file_path(self) -> Optional[str]:
        return os.path.join(self.log_dir_path, self.epoch_file_name or self.batch_file_name) \
            if self.log_dir_path else None

    @property
    def info_file_path(self) -> Optional[str]:
        return os.path.join(self.log_dir_path, self.INFO_FILE_NAME) if self.log_dir_path else None

    def on_train_loop_registration(self) -> None:
        super().on_train_loop_registration()
        self.log_dir_path = self.resolve_log_dir(self.log_dir, self.is_project, "csv_logs")

    # --- the run --------------------------------------------------------------------------------------------
    def start_run(self) -> None:
        self.ensure_log_dir(self.log_dir_path)
        tl = self.train_loop_obj
        dropped = self._keep_rows_up_to(tl.total_iteration_idx, tl.epochs_completed)
        if dropped:
            logger.info("CSVLogger: dropped %d row(s) after batch %d / epoch %d from %s: training continues from there",
                        dropped, tl.total_iteration_idx, tl.epochs_completed, self.log_dir_path)

    def write_rollback(self, record: dict) -> None:
        """The rows logged after the point the run returned to go (the replay logs those batches and epochs again);
        the next row written gets the column ``event`` describing the rollback."""
        tl = self.train_loop_obj
        events: List[str] = []  # an earlier rollback to this point marked a row that goes now: its mark moves on
        self._keep_rows_up_to(tl.total_iteration_idx, tl.epochs_completed, events)
        marks = list(dict.fromkeys(events + ([self._event] if self._event is not None else [])))
        self._event = "; ".join(marks + [describe_rollback(record)])

    def _keep_rows_up_to(self, last_batch: int, epochs_done: int, events: Optional[List[str]] = None) -> int:
        """Open the files keeping the rows of batches up to ``last_batch`` and of epochs before ``epochs_done``;
        how many rows were dropped. The ``event`` cells of the dropped rows are appended to ``events``."""

        def noting_events(keep: Callable[[Dict[str, str]], bool]) -> Callable[[Dict[str, str]], bool]:
            def kept(row: Dict[str, str]) -> bool:
                if keep(row):
                    return True
                if events is not None and row.get("event"):
                    events.append(row["event"])
                return False
            return kept

        @noting_events
        def is_trained_batch(row: Dict[str, str]) -> bool:
            step = _as_int(row.get("total_iteration"))
            return step is not None and step <= last_batch

        @noting_events
        def is_done_epoch(row: Dict[str, str]) -> bool:
            epoch = _as_int(row.get("epoch"))
            return epoch is not None and epoch < epochs_done

        self.batch_table = CSVTable(self.batch_file_path)
        if self.one_file:
            self.epoch_table = self.batch_table
            return self.batch_table.open(lambda row: is_trained_batch(row) if row.get(ROW_KIND_COLUMN) == "batch"
                                         else is_done_epoch(row))
        self.epoch_table = CSVTable(self.epoch_file_path)
        return self.batch_table.open(is_trained_batch) + self.epoch_table.open(is_done_epoch)

    def end_run(self, exception: Optional[BaseException]) -> None:
        for table in (self.batch_table, self.epoch_table):
            if table is not None:
                table.close()
        self.batch_table = self.epoch_table = None
        self.upload_files()

    def on_epoch_end(self) -> None:
        super().on_epoch_end()
        if self.run_active:
            self.upload_files()

    def upload_files(self) -> None:
        """Queue the upload of the files that changed since their last upload, when the run has a bucket
        (``cloud_save_mode`` of the preset) and ``log_dir`` lies in the run folder; returns at once."""
        if self.cloud_destination is None or not self.has_experiment_folder or self.log_dir_path is None:
            return
        run_folder = os.path.abspath(self.experiment_folder.path)
        if os.path.commonpath([run_folder, os.path.abspath(self.log_dir_path)]) != run_folder:
            return
        for path in dict.fromkeys((self.batch_file_path, self.epoch_file_path, self.info_file_path)):
            if os.path.isfile(path):
                self.cloud_upload(path, only_if_changed=True)

    def _update_info(self, **values: Any) -> None:
        info = {}
        if os.path.isfile(self.info_file_path):
            try:
                with open(self.info_file_path, encoding="utf-8") as handle:
                    info = json.load(handle)
            except ValueError:
                info = {}
        info.update(values)
        atomic_write_text(self.info_file_path, json.dumps(info, indent=2, sort_keys=True, default=repr))

    # --- what is logged ---------------------------------------------------------------------------------------
    def _row(self, kind: str, values: Dict[str, Any]) -> Dict[str, Any]:
        if self._event is not None:  # a rollback just before this row
            values, self._event = dict(values, event=self._event), None
        return {ROW_KIND_COLUMN: kind, **values} if self.one_file else values

    def write_hyperparams(self, hyperparams: dict) -> None:
        experiment = self.experiment_folder.path if self.has_experiment_folder else None
        self._update_info(hyperparams=redact_hyperparams(hyperparams), experiment_folder=experiment)

    def write_batch(self, record: BatchRecord) -> None:
        single = list(record.losses) == ["loss"]
        row = {"epoch": record.epoch, "iteration": record.iteration, "total_iteration": record.step}
        for name, value in record.losses.items():
            row["loss" if single else f"loss_{name}"] = value
        for name, value in record.mean_losses.items():
            row["accumulated_loss" if single else f"accumulated_loss_{name}"] = value
        for (optimizer_idx, group_idx), rate in record.learning_rates.items():
            row[f"lr_optimizer_{optimizer_idx}_group_{group_idx}"] = rate
        self.batch_table.append(self._row("batch", row))

    def write_epoch_metrics(self, epoch: int, step: int, metrics: Dict[str, float], train_end: bool) -> None:
        if train_end:
            def is_last_epoch(row: Dict[str, str]) -> bool:
                return _as_int(row.get("epoch")) == epoch and (not self.one_file or row.get(ROW_KIND_COLUMN) == "epoch")

            if self.epoch_table.merge_into_last(is_last_epoch, metrics):
                return
        self.epoch_table.append(self._row("epoch", {"epoch": epoch, "total_iteration": step, **metrics}))

    def write_final_model_path(self, path: str) -> None:
        self._update_info(final_model_path=path)


__all__ = ["CSVLogger", "CSVTable", "PER_OPTIMIZER_STEP"]
