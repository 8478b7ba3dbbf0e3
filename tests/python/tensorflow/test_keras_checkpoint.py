"""``BestModelCheckpoint`` takes Horovod's positional arguments in Horovod's order (monitor,
verbose, save_weights_only, mode, save_freq) and keeps the best model of a real ``fit``."""

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")

from ferrovod.tensorflow.keras.callbacks import BestModelCheckpoint  # noqa: E402


def test_positional_arguments_in_horovods_order():
    cb = BestModelCheckpoint("val_accuracy", 1, True, "max", 3)
    assert (cb.monitor, cb.verbose, cb.save_weights_only, cb.mode, cb.save_freq) == (
        "val_accuracy", 1, True, "max", 3)
    assert cb.save_best_only and cb.filepath is None


def test_it_keeps_the_best_epoch_of_a_fit(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    path = tmp_path / "best.weights.h5"
    cb = BestModelCheckpoint("val_loss", 0, True, "min", filepath=str(path))
    hist = model.fit(x, y, validation_data=(x, y), epochs=4, batch_size=16, verbose=0,
                     callbacks=[cb])
    assert path.exists()
    assert cb.best == pytest.approx(min(hist.history["val_loss"]))
    with pytest.raises(ValueError, match="needs a filepath"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[BestModelCheckpoint()])
