"""Where the retrieval artifacts live inside the model repository."""

TWO_TOWER_FILE = "retrieval/two_tower.safetensors"
TWO_TOWER_CONFIG_FILE = "retrieval/two_tower.json"
EMBEDDINGS_FILE = "retrieval/item_embeddings.safetensors"
INDEX_FILE = "retrieval/index.faiss"
INDEX_SPEC_FILE = "retrieval/index.json"
