//! `POST /v1/chat/completions`.

use serde::{Deserialize, Serialize};

use crate::common::{NoUnknownFields, SamplingFields, MAX_TOP_LOGPROBS};
use crate::structured::StructuredFields;
use crate::tools::{tool_use, Tool, ToolCall, ToolCallDelta, ToolChoice, ToolUse};
use crate::{Usage, Validate, ValidationError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Message content: a string or a list of parts (only `text` parts are supported).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentPart {
    Text { text: String },
}

impl MessageContent {
    /// The text of the message, parts joined with newlines (as vLLM does).
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(t) => t.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .map(|ContentPart::Text { text }| text.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The calls an assistant turn made (history sent back by the client).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// On a `tool` turn: the call this result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A plain text turn.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        ChatMessage { role, content: Some(MessageContent::Text(content.into())), name: None, tool_calls: None, tool_call_id: None }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    /// OpenAI's newer name for `max_tokens` (which lives in [`SamplingFields`]); wins when both are set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// `response_format`, `structured_outputs`, `guided_*`.
    #[serde(flatten)]
    pub structured: StructuredFields,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Must stay the last field: it takes what the fields above did not.
    #[serde(flatten)]
    pub unknown: NoUnknownFields,
}

impl ChatCompletionRequest {
    /// `max_completion_tokens` wins over the deprecated `max_tokens`, as in OpenAI's API.
    pub fn max_tokens(&self) -> Option<i64> {
        self.max_completion_tokens.or(self.sampling.max_tokens)
    }

    /// What the request asks about tools (checked in `validate`).
    pub fn tool_use(&self) -> Result<ToolUse, ValidationError> {
        tool_use(self.tools.as_deref(), self.tool_choice.as_ref(), self.parallel_tool_calls)
    }
}

impl Validate for ChatCompletionRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        let max_tokens_param = if self.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
        self.sampling.validate(self.max_tokens(), max_tokens_param)?;
        let constraint = self.structured.constraint()?;
        let tools = self.tool_use()?;
        if let (Some(c), ToolUse::Required { .. } | ToolUse::Named(_)) = (&constraint, &tools) {
            return Err(ValidationError::new(
                c.param,
                "a forced tool call (tool_choice `required` or a named function) cannot be combined with another output constraint",
            ));
        }
        if self.messages.is_empty() {
            return Err(ValidationError::new("messages", "messages must not be empty"));
        }
        if let Some(t) = self.top_logprobs {
            if t > MAX_TOP_LOGPROBS {
                return Err(ValidationError::new("top_logprobs", format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {t}")));
            }
            if !self.logprobs {
                return Err(ValidationError::new("top_logprobs", "top_logprobs requires logprobs to be true"));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub role: Role,
    pub content: Option<String>,
    /// Present only when the model called tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

/// One `data:` event of a streamed chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Present (as null until the last event) only when `stream_options.include_usage` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// The change one chunk brings: the role on the first chunk, then content.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}
