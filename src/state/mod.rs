//! The loop state: its model and its store.

pub mod backup;
pub mod model;
pub mod store;
pub mod tasks;
