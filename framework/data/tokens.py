"""The names framework.data.tokens held before issue 65 split it (format: token_files, datasets:
datasets and prompts, config helpers: dataset_config, checks: checks), for the modules that
still import them from here; it goes once they import from their homes."""
from framework.data.batch import IGNORE
from framework.data.checks import check_document_masking, check_responses, check_token_data
from framework.data.dataset_config import kind_of, tokenizer_of, tokens_vocab
from framework.data.datasets import InstructionDataset, TokenDataset, positions_in_documents
from framework.data.token_files import read_meta

__all__ = ["IGNORE", "InstructionDataset", "TokenDataset", "check_document_masking", "check_responses",
           "check_token_data", "kind_of", "positions_in_documents", "read_meta", "tokenizer_of", "tokens_vocab"]
