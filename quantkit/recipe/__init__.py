"""Recipes: the validated, versioned description of one quantization job."""

from quantkit.recipe.load import load_recipe
from quantkit.recipe.plan import LayerPlan, resolve_layer
from quantkit.recipe.schema import SCHEMA_VERSION, RecipeModel

__all__ = ["SCHEMA_VERSION", "LayerPlan", "RecipeModel", "load_recipe", "resolve_layer"]
