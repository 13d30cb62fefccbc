"""The training history: a dict of lists, one value appended per epoch (or per evaluation)."""
from typing import Any, Dict, List


class TrainingHistory(dict):
    """A ``dict`` mapping a metric name (``'loss'``, ``'val_loss'``, ``'val_Accuracy'``...) to a list of values.

    Reading a metric that was never recorded raises ``KeyError`` like any dict; :meth:`get` returns
    the default as usual.
    """

    def insert_single_result_into_history(self, metric_name: str, metric_result: Any) -> None:
        """Append one value to the list of ``metric_name``, creating the list when needed."""
        self.setdefault(metric_name, []).append(metric_result)

    def get_train_history_dict(self) -> Dict[str, List[Any]]:
        """Return a plain ``dict`` copy (lists copied too), e.g. for JSON serialisation."""
        return {name: list(values) for name, values in self.items()}
