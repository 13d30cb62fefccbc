"""Naive AMP: the whole model in low precision ("all operations are performed in fp16").

Mapped onto apex's levels as O3 - the model, its gradients and the optimizer state are cast to float16
(bfloat16 on a CPU), with no float32 master weights and no float32 BatchNorm (this ViT has LayerNorm only,
which also runs in the low-precision type). Dynamic loss scaling is switched on, because float16 gradients
of a transformer underflow without it; on a CPU (bfloat16) it is harmless.

The same setting written the other way round: {"opt_level": "O2", "master_weights": False,
"keep_batchnorm_fp32": False} casts the model identically.
TrainLoop(use_amp={"opt_level": "O3", "keep_batchnorm_fp32": False, "loss_scale": "dynamic"}).
"""

# --- training -----------------------------------------------------------------------------------------
BATCH_SIZE = 64             # per process
NUM_EPOCHS = 3
LEARNING_RATE = 1e-3        # AdamW
WEIGHT_DECAY = 0.05

# --- data: synthetic images, generated in memory (see vit.py) ------------------------------------------
NUM_TRAIN_SAMPLES = 2048
NUM_TEST_SAMPLES = 512
NUM_CLASSES = 10
IMAGE_SIZE = 32
PATCH_SIZE = 4

# --- model: a small ViT (ViT-Base/16 is HIDDEN_SIZE 768, DEPTH 12, NUM_HEADS 12, IMAGE_SIZE 224, PATCH_SIZE 16)
HIDDEN_SIZE = 128
DEPTH = 4
NUM_HEADS = 4
MLP_RATIO = 4
DROPOUT = 0.0

# --- precision ------------------------------------------------------------------------------------
NAME = "AMP naive"
AMP = {"opt_level": "O3", "keep_batchnorm_fp32": False, "loss_scale": "dynamic"}
