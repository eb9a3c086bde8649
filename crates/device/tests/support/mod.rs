//! A `tracing` layer that keeps every event it sees, for assertions.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

/// One recorded event: level, target and fields (the message under `message`).
#[derive(Debug, Clone)]
pub struct Ev {
    pub level: Level,
    pub target: String,
    pub fields: BTreeMap<String, String>,
}

impl Ev {
    /// The field's value as the event wrote it (`%` and `format_args!` as displayed,
    /// strings without quotes).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
}

/// The layer; clones share one list.
#[derive(Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<Ev>>>);

impl Collector {
    /// Everything recorded so far.
    pub fn events(&self) -> Vec<Ev> {
        self.0.lock().unwrap().clone()
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl<S: Subscriber> Layer<S> for Collector {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(Ev {
            level: *event.metadata().level(),
            target: event.metadata().target().to_string(),
            fields,
        });
    }
}
