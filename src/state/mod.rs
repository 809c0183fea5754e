//! The loop state: its model and its store.

pub mod model;
pub mod store;
