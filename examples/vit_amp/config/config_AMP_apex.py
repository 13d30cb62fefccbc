"""apex AMP O1: the forward under autocast, float32 weights, dynamic loss scaling.

apex's "O1" patched torch functions to run in float16; aitoolbox's amp runs the forward under torch.autocast
instead (float16 on CUDA, bfloat16 on a CPU). TrainLoop(use_amp={"opt_level": "O1"}), i.e.
``amp.initialize(model, optimizer, opt_level="O1")``.
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
NAME = "AMP apex O1"
AMP = {"opt_level": "O1"}
