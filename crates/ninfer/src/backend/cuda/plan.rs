//! Host-side planning of a CUDA step, free of any device call so it is unit-tested anywhere.
//!
//! A step's rows are cut into *passes* of at most `cap` tokens (the activation workspace is
//! planned for `cap`, DESIGN.md §5: nothing is allocated per token). Each pass is one forward
//! over a batch of sequence segments laid out back to back; a row longer than the room left in a
//! pass continues in the next one, so its later tokens see the KV and GDN state its earlier
//! tokens wrote. Every pass also gets its small integer tables (token ids, positions, KV rows,
//! sequence offsets, state slots, KV lengths, block table, logit rows) packed into one `i32`
//! buffer with fixed offsets, uploaded with one copy.

/// Which positions of a segment need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    None,
    Last,
    All,
}

/// A contiguous piece of one step row inside a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seg {
    /// Index of the step row.
    pub row: usize,
    pub slot: u32,
    /// First token of the piece within the row's tokens.
    pub tok0: usize,
    pub n: usize,
    /// Position of the first token (tokens already in the slot's sequence before it).
    pub pos0: usize,
    pub want: Want,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Pass {
    pub segs: Vec<Seg>,
    pub tokens: usize,
}

/// One step row as the planner sees it: slot, tokens already in the slot, new tokens, and
/// whether every position wants logits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowSpec {
    pub slot: u32,
    pub have: usize,
    pub n: usize,
    pub all_logits: bool,
}

/// Cuts the rows into passes of at most `cap` tokens, each row's pieces in order in successive
/// passes. Empty rows get no segment.
pub(crate) fn split_passes(rows: &[RowSpec], cap: usize) -> Vec<Pass> {
    assert!(cap > 0, "pass capacity is positive");
    let mut done = vec![0usize; rows.len()];
    let mut passes = Vec::new();
    loop {
        let mut pass = Pass::default();
        for (i, r) in rows.iter().enumerate() {
            let room = cap - pass.tokens;
            let left = r.n - done[i];
            if left == 0 || room == 0 {
                continue;
            }
            let n = left.min(room);
            let last = done[i] + n == r.n;
            let want = if r.all_logits {
                Want::All
            } else if last {
                Want::Last
            } else {
                Want::None
            };
            pass.segs.push(Seg { row: i, slot: r.slot, tok0: done[i], n, pos0: r.have + done[i], want });
            pass.tokens += n;
            done[i] += n;
        }
        if pass.segs.is_empty() {
            return passes;
        }
        passes.push(pass);
    }
}

/// Sizes of the per-pass integer tables and their offsets in the packed buffer: the buffer's
/// capacities, or one pass's own sizes (`PassMeta::layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MetaLayout {
    /// Tokens per pass.
    pub t_cap: usize,
    /// Sequences per pass (the slot count: each row is a distinct slot).
    pub s_cap: usize,
    /// Block-table entries per sequence (KV pages of one slot).
    pub pages: usize,
}

impl MetaLayout {
    pub fn ids(&self) -> usize {
        0
    }
    pub fn pos(&self) -> usize {
        self.t_cap
    }
    pub fn kv_rows(&self) -> usize {
        2 * self.t_cap
    }
    pub fn gather(&self) -> usize {
        3 * self.t_cap
    }
    pub fn zeros(&self) -> usize {
        4 * self.t_cap
    }
    pub fn cu(&self) -> usize {
        5 * self.t_cap
    }
    pub fn slots(&self) -> usize {
        self.cu() + self.s_cap + 1
    }
    pub fn kv_len(&self) -> usize {
        self.slots() + self.s_cap
    }
    pub fn block_table(&self) -> usize {
        self.kv_len() + self.s_cap
    }
    /// Total `i32` entries.
    pub fn len(&self) -> usize {
        self.block_table() + self.s_cap * self.pages
    }
}

/// The packed tables of one pass and the host-side facts the launches need.
#[derive(Debug, Clone)]
pub(crate) struct PassMeta {
    pub data: Vec<i32>,
    pub seqs: usize,
    pub tokens: usize,
    pub max_q: usize,
    pub max_kv: usize,
    /// Block-table row stride used by this pass (pages covering `max_kv`).
    pub bt_stride: usize,
    /// For every gathered logit row in order: (segment index, token offset in the segment).
    pub logit_rows: Vec<(usize, usize)>,
}

impl PassMeta {
    /// Where each table of `data` starts: packed for this pass's own sizes.
    pub fn layout(&self) -> MetaLayout {
        MetaLayout { t_cap: self.tokens, s_cap: self.seqs, pages: self.bt_stride }
    }
}

impl Pass {
    /// A pass of one new token per sequence with the last logits of each: the shape a decode
    /// step has, which is captured as a CUDA graph per sequence count.
    pub fn is_decode(&self) -> bool {
        self.segs.iter().all(|s| s.n == 1 && s.want == Want::Last)
    }
}

/// The KV length a decode graph is captured for: the next power of two of `max_kv` from 512,
/// within `cap` (the slot's pages). Few graphs cover every length, and the attention launch of
/// a graph splits the cache for the bucket's length, of which the sequences use at least half.
pub(crate) fn kv_bucket(max_kv: usize, cap: usize) -> usize {
    max_kv.next_power_of_two().max(512).min(cap).max(max_kv)
}

/// Fills the tables of `pass`: `tokens_of(seg)` gives the segment's token ids and `pages_of(slot)`
/// the pool pages the slot holds, in position order (enough for every token of the pass):
/// position p of a slot lives in cache row `pages[p / page_size]·page_size + p % page_size`.
/// `kv_pad`, when given (a graph's bucket, at most `cap.pages` pages), replaces the longest
/// KV length of the launches and sizes the block table; the entries past a slot's own pages
/// repeat its first page (never read: attention stops at each sequence's length).
///
/// The tables are packed for the pass itself (its tokens, sequences and block-table stride,
/// each within `cap`), so a decode step uploads a few dozen words rather than the capacity of
/// a prompt chunk (86k words at a 16,384-token chunk and 16 slots). A decode pass of a given
/// sequence count and bucket packs the same way every step, which the graph captured for it
/// relies on.
pub(crate) fn pass_meta<'t, 'p>(
    cap: &MetaLayout,
    page_size: usize,
    pass: &Pass,
    kv_pad: Option<usize>,
    tokens_of: impl Fn(&Seg) -> &'t [u32],
    pages_of: impl Fn(u32) -> &'p [u32],
) -> PassMeta {
    let seqs = pass.segs.len();
    let tokens: usize = pass.segs.iter().map(|s| s.n).sum();
    let mut max_kv = pass.segs.iter().map(|s| s.pos0 + s.n).max().unwrap_or(0);
    if let Some(pad) = kv_pad {
        assert!(pad >= max_kv && pad <= cap.pages * page_size, "kv pad {pad} outside {max_kv}..={}", cap.pages * page_size);
        max_kv = pad;
    }
    let bt_stride = max_kv.div_ceil(page_size).max(1);
    let layout = MetaLayout { t_cap: tokens, s_cap: seqs, pages: bt_stride };
    assert!(tokens <= cap.t_cap && seqs <= cap.s_cap && bt_stride <= cap.pages, "pass {layout:?} outside {cap:?}");
    let mut d = vec![0i32; layout.len()];
    let (mut t, mut max_q) = (0usize, 0usize);
    let mut logit_rows = Vec::new();
    for (s, seg) in pass.segs.iter().enumerate() {
        let toks = tokens_of(seg);
        debug_assert_eq!(toks.len(), seg.n);
        d[layout.cu() + s] = t as i32;
        for (j, &id) in toks.iter().enumerate() {
            let pos = seg.pos0 + j;
            d[layout.ids() + t + j] = id as i32;
            d[layout.pos() + t + j] = pos as i32;
            let page = pages_of(seg.slot)[pos / page_size] as usize;
            d[layout.kv_rows() + t + j] = (page * page_size + pos % page_size) as i32;
        }
        match seg.want {
            Want::None => {}
            Want::Last => logit_rows.push((s, seg.n - 1)),
            Want::All => logit_rows.extend((0..seg.n).map(|j| (s, j))),
        }
        let kv = seg.pos0 + seg.n;
        d[layout.slots() + s] = seg.slot as i32;
        d[layout.kv_len() + s] = kv as i32;
        t += seg.n;
        max_q = max_q.max(seg.n);
    }
    d[layout.cu() + seqs] = t as i32;
    let starts: Vec<usize> = pass.segs.iter().scan(0, |acc, s| {
        let start = *acc;
        *acc += s.n;
        Some(start)
    }).collect();
    for (k, &(s, j)) in logit_rows.iter().enumerate() {
        d[layout.gather() + k] = (starts[s] + j) as i32;
    }
    for (s, seg) in pass.segs.iter().enumerate() {
        let pages = pages_of(seg.slot);
        for p in 0..bt_stride {
            d[layout.block_table() + s * bt_stride + p] = *pages.get(p).unwrap_or(&pages[0]) as i32;
        }
    }
    PassMeta { data: d, seqs, tokens: t, max_q, max_kv, bt_stride, logit_rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(slot: u32, have: usize, n: usize, all_logits: bool) -> RowSpec {
        RowSpec { slot, have, n, all_logits }
    }

    #[test]
    fn rows_split_into_passes_in_order() {
        // Three decode rows and a 10-token prompt with room for 6 tokens per pass.
        let rows = [row(0, 5, 1, false), row(3, 0, 10, false), row(1, 2, 1, false), row(2, 9, 0, true)];
        let passes = split_passes(&rows, 6);
        assert_eq!(passes.len(), 2);
        let p0: Vec<(usize, usize, usize, Want)> = passes[0].segs.iter().map(|s| (s.row, s.tok0, s.n, s.want)).collect();
        assert_eq!(p0, vec![(0, 0, 1, Want::Last), (1, 0, 5, Want::None)]);
        assert_eq!(passes[0].tokens, 6);
        let p1: Vec<(usize, usize, usize, usize, Want)> =
            passes[1].segs.iter().map(|s| (s.row, s.tok0, s.n, s.pos0, s.want)).collect();
        assert_eq!(p1, vec![(1, 5, 5, 5, Want::Last), (2, 0, 1, 2, Want::Last)]);
        // Every token of every row is covered exactly once.
        let total: usize = passes.iter().map(|p| p.tokens).sum();
        assert_eq!(total, 12);
        assert!(split_passes(&[row(0, 0, 0, true)], 4).is_empty());
    }

    #[test]
    fn all_logits_rows_want_every_piece() {
        let passes = split_passes(&[row(1, 3, 7, true)], 4);
        let wants: Vec<(usize, usize, Want)> = passes.iter().map(|p| (p.segs[0].pos0, p.segs[0].n, p.segs[0].want)).collect();
        assert_eq!(wants, vec![(3, 4, Want::All), (7, 3, Want::All)]);
    }

    #[test]
    fn meta_tables_follow_the_layout() {
        let cap = MetaLayout { t_cap: 8, s_cap: 3, pages: 4 };
        assert_eq!(cap.len(), 5 * 8 + 4 + 3 + 3 + 12);
        let toks: Vec<Vec<u32>> = vec![vec![7], vec![10, 11, 12], vec![20, 21]];
        let rows = [row(2, 130, 1, false), row(0, 0, 3, true), row(1, 64, 2, false)];
        let pass = split_passes(&rows, 8).remove(0);
        // Slot s holds pages 4s, 4s + 1, ... of the pool.
        let pages: Vec<Vec<u32>> = (0..3).map(|s| (0..4).map(|p| 4 * s + p).collect()).collect();
        let m = pass_meta(&cap, 64, &pass, None, |s| &toks[s.row][s.tok0..s.tok0 + s.n], |slot| &pages[slot as usize]);
        let d = &m.data;
        assert_eq!((m.seqs, m.tokens, m.max_q, m.max_kv), (3, 6, 3, 131));
        // Packed for the pass: 6 tokens, 3 sequences, 3 pages a row (131 positions of 64).
        assert_eq!(m.layout(), MetaLayout { t_cap: 6, s_cap: 3, pages: 3 });
        assert_eq!(d.len(), 5 * 6 + 4 + 3 + 3 + 9);
        assert_eq!(&d[..6], &[7, 10, 11, 12, 20, 21]);
        assert_eq!(&d[6..12], &[130, 0, 1, 2, 64, 65]);
        // Slot s's rows start at 4s·64.
        assert_eq!(&d[12..18], &[2 * 256 + 130, 0, 1, 2, 256 + 64, 256 + 65]);
        // Logit rows: the decode row, every prompt position, the last of the third row.
        assert_eq!(m.logit_rows, vec![(0, 0), (1, 0), (1, 1), (1, 2), (2, 1)]);
        assert_eq!(&d[18..23], &[0, 1, 2, 3, 5]);
        assert_eq!(&d[30..34], &[0, 1, 4, 6]);
        assert_eq!(&d[34..37], &[2, 0, 1]);
        assert_eq!(&d[37..40], &[131, 3, 66]);
        // Row s of the block table lists slot s's pages.
        assert_eq!(m.bt_stride, 3);
        assert_eq!(&d[40..49], &[8, 9, 10, 0, 1, 2, 4, 5, 6]);
        // The zero ids stay zero (the shared expert's id table when it runs on its own).
        assert!(d[24..30].iter().all(|&z| z == 0));
        assert!(!pass.is_decode());
    }

    #[test]
    fn decode_passes_pad_their_kv_length_to_a_bucket() {
        let cap = MetaLayout { t_cap: 8, s_cap: 3, pages: 16 };
        let toks: Vec<Vec<u32>> = vec![vec![7], vec![8]];
        let pass = split_passes(&[row(0, 100, 1, false), row(2, 600, 1, false)], 8).remove(0);
        assert!(pass.is_decode());
        let bucket = kv_bucket(601, cap.pages * 64);
        assert_eq!(bucket, 1024);
        assert_eq!(kv_bucket(3, 1024), 512);
        assert_eq!(kv_bucket(900, 960), 960);
        // Pages come from the pool in any order.
        let pages: Vec<Vec<u32>> = vec![vec![9, 3], vec![], vec![5, 0, 7, 1, 2, 4, 6, 8, 10, 11]];
        let m = pass_meta(&cap, 64, &pass, Some(bucket), |s| &toks[s.row][s.tok0..s.tok0 + s.n], |slot| &pages[slot as usize]);
        assert_eq!((m.max_kv, m.bt_stride), (1024, 16));
        let layout = m.layout();
        assert_eq!(layout, MetaLayout { t_cap: 2, s_cap: 2, pages: 16 });
        // The true lengths stay in the table; KV rows follow each slot's pages.
        assert_eq!(&m.data[layout.kv_len()..layout.kv_len() + 2], &[101, 601]);
        assert_eq!(&m.data[layout.kv_rows()..layout.kv_rows() + 2], &[3 * 64 + 36, 11 * 64 + 24]);
        // Block-table rows list the slot's pages, then repeat its first page up to the bucket.
        let bt = &m.data[layout.block_table()..];
        assert_eq!(bt.len(), 2 * 16);
        assert_eq!(&bt[..4], &[9, 3, 9, 9]);
        assert_eq!(&bt[16..28], &[5, 0, 7, 1, 2, 4, 6, 8, 10, 11, 5, 5]);
        // A later step of the same sequence count and bucket packs the same way: the offsets
        // its captured graph holds still name its tables.
        let later = split_passes(&[row(0, 40, 1, false), row(2, 630, 1, false)], 8).remove(0);
        let m2 = pass_meta(&cap, 64, &later, Some(bucket), |s| &toks[s.row][..s.n], |slot| &pages[slot as usize]);
        assert_eq!((m2.layout(), m2.data.len()), (layout, m.data.len()));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_pass_beyond_the_tables_capacity_is_refused() {
        let cap = MetaLayout { t_cap: 8, s_cap: 3, pages: 2 };
        let pass = split_passes(&[row(0, 200, 1, false)], 8).remove(0);
        let pages: Vec<Vec<u32>> = vec![vec![0, 1, 2, 3]];
        pass_meta(&cap, 64, &pass, None, |_| &[5], |slot| &pages[slot as usize]);
    }
}
