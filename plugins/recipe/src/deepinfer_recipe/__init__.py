"""DeepInfer's deepseek-recipe plugin: DeepSeek tokenizers, chat encodings and API response parsing."""

from deepinfer_recipe.encoding import RecipeChatEncoding
from deepinfer_recipe.stream import RecipeOutputStream
from deepinfer_recipe.tokenizer import DeepseekTokenizer, TokenizerError, load_tokenizer

__all__ = ["DeepseekTokenizer", "RecipeChatEncoding", "RecipeOutputStream", "TokenizerError", "load_tokenizer"]
