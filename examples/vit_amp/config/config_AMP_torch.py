"""Torch AMP: forward under torch.autocast, dynamic loss scaling on CUDA (what torch.amp.GradScaler does).

TrainLoop(use_amp=True): float16 autocast with dynamic loss scaling on a CUDA GPU, bfloat16 autocast on a
CPU (bfloat16 keeps float32's exponent range, so no loss scaling is needed there). Weights, gradients and
optimizer state stay float32.
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
NAME = "AMP torch"
AMP = True
