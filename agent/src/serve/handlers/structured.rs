//! A request's structured-output fields → the engine's compiled grammar.

use peregrine_api::structured::{NamedConstraint, OutputConstraint};
use peregrine_api::StructuredFields;
use peregrine_engine::structured::{CompiledGrammar, GrammarSpec};

use crate::serve::backend::InferenceBackend;
use crate::serve::error::ApiError;

/// The compiled grammar of the request's constraint, None when it asks for none. Field-level
/// checks already ran in validation; what is left (a schema llguidance cannot use, a regex or
/// grammar that does not parse) is a 400 naming the field.
pub async fn grammar<B: InferenceBackend>(backend: &B, fields: &StructuredFields) -> Result<Option<CompiledGrammar>, ApiError> {
    let Some(NamedConstraint { param, constraint }) = fields.constraint()? else { return Ok(None) };
    let spec = match constraint {
        OutputConstraint::JsonObject => GrammarSpec::JsonObject,
        OutputConstraint::JsonSchema(schema) => GrammarSpec::JsonSchema(schema),
        OutputConstraint::Regex(rx) => GrammarSpec::Regex(rx),
        OutputConstraint::Choice(choices) => GrammarSpec::Choice(choices),
        OutputConstraint::Grammar(lark) => GrammarSpec::Lark(lark),
    };
    backend.compile_grammar(spec, param).await.map(Some)
}
