"""Where the ranking artifacts live inside the model repository."""

DLRM_FILE = "ranking/dlrm.safetensors"
DLRM_CONFIG_FILE = "ranking/dlrm.json"
