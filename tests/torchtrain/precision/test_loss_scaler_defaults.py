"""The dynamic loss scale's defaults reached only by long runs (apex's: ceiling 2**24, growth by 2, backoff by 1/2).

Written for the mutation run (tests/mutation/): a changed default ceiling survived every shorter test, yet it
changes what a run of more than 16,000 unskipped steps trains."""
from aitoolbox.torchtrain.precision import LossScaler
from aitoolbox.torchtrain.precision.loss_scaler import GROWTH_INTERVAL


def _grown(scaler: LossScaler, windows: int) -> LossScaler:
    for _ in range(windows * GROWTH_INTERVAL):
        scaler.update(False)
    return scaler


def test_the_default_ceiling_is_2_24():
    scaler = LossScaler()
    scaler.load_state_dict({"loss_scale": 2.0 ** 23, "unskipped": 0})
    assert _grown(scaler, 1).loss_scale == 2.0 ** 24
    assert _grown(scaler, 1).loss_scale == 2.0 ** 24  # capped: a further window does not grow it


def test_the_default_growth_doubles_and_backoff_halves():
    scaler = _grown(LossScaler(), 3)
    assert scaler.loss_scale == 2.0 ** 19
    scaler.update(True)
    assert scaler.loss_scale == 2.0 ** 18 and scaler.unskipped == 0
