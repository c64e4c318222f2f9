//! Stop strings across token boundaries. Text from the detokenizer goes in; text that is certainly
//! not part of a stop string comes out. A tail that could still grow into a stop string is held
//! back, so nothing a user has seen is ever taken back (DESIGN.md §3).

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

pub enum StopScan {
    /// Text safe to emit now; generation continues.
    Continue(String),
    /// Text before the stop string, and the stop string; generation ends (the stop string itself
    /// is not emitted).
    Stopped(String, String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, held: String::new() }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return StopScan::Continue(std::mem::take(&mut self.held));
        }
        // The earliest complete match ends generation.
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s))).min_by_key(|m| m.0);
        if let Some((pos, stop)) = first {
            let out = self.held[..pos].to_string();
            self.held.clear();
            return StopScan::Stopped(out, stop.clone());
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopScan::Continue(out)
    }

    /// The sequence ended for another reason: whatever was held back is ordinary text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopScan::Continue(t) => out.push_str(&t),
                StopScan::Stopped(t, _) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "N", "x"]), ("abc ENx".into(), false));
        assert_eq!(run(&["\n\n", "stop"], &["a\n", "b", "\n", "\nc"]), ("a\nb".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_cannot_match() {
        let mut m = StopMatcher::new(vec!["</s>".into()]);
        match m.push("x</") {
            StopScan::Continue(t) => assert_eq!(t, "x"),
            StopScan::Stopped(..) => panic!(),
        }
        match m.push("p>") {
            StopScan::Continue(t) => assert_eq!(t, "</p>"),
            StopScan::Stopped(..) => panic!(),
        }
    }
}
