"""FP32 training: every operation in float32.

TrainLoop(use_amp=False).
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
NAME = "FP32 training"
AMP = False
