//! The router: OpenAI endpoints behind API-key auth and per-tenant request limits; probes,
//! metrics and version open. The LoRA admin endpoints need an admin key (`--admin-api-key`);
//! tenant keys get 403 there.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use super::auth::{bearer_token, AdminAccess};
use super::backend::InferenceBackend;
use super::body_limits::limit_body;
use super::error::ApiError;
use super::handlers::{chat, completions, fail, lora, probes};
use super::state::AppState;
use super::tenant::Tenant;


/// Routes that need an API key when keys are configured.
pub fn api_routes<B: InferenceBackend>() -> Router<Arc<AppState<B>>> {
    Router::new()
        .route("/v1/completions", post(completions::handle::<B>))
        .route("/v1/chat/completions", post(chat::handle::<B>))
        .route("/v1/models", get(probes::models::<B>))
}

/// Adapter admin: loads read server files, and the list shows where adapters came from.
pub fn admin_routes<B: InferenceBackend>() -> Router<Arc<AppState<B>>> {
    Router::new()
        .route("/v1/load_lora_adapter", post(lora::load::<B>))
        .route("/v1/unload_lora_adapter", post(lora::unload::<B>))
        .route("/v1/adapters", get(lora::list::<B>))
}

pub fn router<B: InferenceBackend>(state: Arc<AppState<B>>) -> Router {
    router_with(state, Router::new())
}

/// [`router`] with `extra` routes behind the same keys and limits (the encoder endpoints).
pub fn router_with<B: InferenceBackend>(state: Arc<AppState<B>>, extra: Router<Arc<AppState<B>>>) -> Router {
    let authed = api_routes::<B>().merge(extra).route_layer(middleware::from_fn_with_state(state.clone(), require_key::<B>));
    let admin = admin_routes::<B>().route_layer(middleware::from_fn_with_state(state.clone(), require_admin_key::<B>));
    Router::new()
        .merge(authed)
        .merge(admin)
        .route("/health", get(probes::health))
        .route("/ready", get(probes::ready::<B>))
        .route("/metrics", get(probes::metrics::<B>))
        .route("/version", get(probes::version::<B>))
        .fallback(probes::not_found)
        .method_not_allowed_fallback(probes::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), limit_body::<B>))
        .with_state(state)
}

async fn require_key<B: InferenceBackend>(
    State(state): State<Arc<AppState<B>>>,
    mut request: Request,
    next: Next,
) -> Response {
    let presented = request.headers().get(AUTHORIZATION).map(|h| h.as_bytes());
    match authorize(&state, presented) {
        Ok(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        Err(e) => fail(&state, e),
    }
}

/// The tenant of an `Authorization` header's value (any, when no keys are configured), after its
/// requests-per-minute limit; for HTTP's routes and the gRPC service alike.
pub fn authorize<B: InferenceBackend>(state: &AppState<B>, authorization: Option<&[u8]>) -> Result<Tenant, ApiError> {
    if state.keys.is_open() {
        return Ok(Tenant(None));
    }
    let presented = authorization.and_then(bearer_token);
    let Some(tenant) = presented.and_then(|key| state.keys.authenticate(key)) else {
        let why = if presented.is_some() { "incorrect API key provided" } else { "missing API key (Authorization: Bearer KEY)" };
        return Err(ApiError::Unauthorized(why.to_string()));
    };
    if let Err(r) = state.limiter.check_request(tenant, state.keys.limits(tenant), Instant::now()) {
        return Err(ApiError::RateLimited {
            message: format!("rate limit reached for {} per minute; retry after {:.1}s", r.what, r.retry_after.as_secs_f64()),
            retry_after: r.retry_after,
        });
    }
    Ok(Tenant(Some(tenant)))
}

async fn require_admin_key<B: InferenceBackend>(State(state): State<Arc<AppState<B>>>, request: Request, next: Next) -> Response {
    let presented = request.headers().get(AUTHORIZATION).and_then(|h| bearer_token(h.as_bytes()));
    match state.keys.admin_access(presented) {
        AdminAccess::Allowed => next.run(request).await,
        AdminAccess::Forbidden => fail(
            &state,
            ApiError::Forbidden("this API key may not manage LoRA adapters; use an admin key (--admin-api-key)".to_string()),
        ),
        AdminAccess::Unauthenticated => {
            let why = if presented.is_some() { "incorrect admin API key provided" } else { "missing admin API key (Authorization: Bearer KEY)" };
            fail(&state, ApiError::Unauthorized(why.to_string()))
        }
    }
}
