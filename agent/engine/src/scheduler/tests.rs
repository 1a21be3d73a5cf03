use super::*;

fn sched(num_blocks: usize, block_size: usize, max_seqs: usize, max_tokens: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig { max_num_seqs: max_seqs, max_num_batched_tokens: max_tokens, lookahead: true },
        BlockManager::new(num_blocks, block_size, false),
    )
}

fn add(s: &mut Scheduler, id: SeqId, prompt_len: u32) {
    s.add(Sequence::new(id, (0..prompt_len).map(|t| t + 100 * id as u32).collect()));
}

/// Runs a step as the engine would: marks it computed and appends `token` for every logits row.
fn step(s: &mut Scheduler, token: u32) -> SchedulerOutput {
    let out = s.schedule();
    s.step_done(&out);
    for c in out.chunks.iter().filter(|c| c.wants_logits) {
        s.append_token(c.id, token);
    }
    out
}

fn summary(out: &SchedulerOutput) -> Vec<(SeqId, usize, usize, bool, bool)> {
    out.chunks.iter().map(|c| (c.id, c.context_len, c.num_tokens, c.wants_logits, c.is_decode)).collect()
}

#[test]
fn long_prompt_is_chunked_within_the_token_budget() {
    let mut s = sched(100, 4, 4, 8);
    add(&mut s, 1, 20);
    assert_eq!(summary(&step(&mut s, 7)), vec![(1, 0, 8, false, false)]);
    assert_eq!(summary(&step(&mut s, 7)), vec![(1, 8, 8, false, false)]);
    let last = step(&mut s, 7);
    assert_eq!(summary(&last), vec![(1, 16, 4, true, false)]);
    assert_eq!(last.batch.positions, (16..20).collect::<Vec<u32>>());
    assert_eq!(summary(&step(&mut s, 8)), vec![(1, 20, 1, true, true)]);
    assert_eq!(s.get(1).unwrap().output(), &[7, 8]);
}

#[test]
fn decodes_come_first_then_prefill_fills_the_budget() {
    let mut s = sched(100, 4, 4, 8);
    add(&mut s, 1, 3);
    step(&mut s, 50);
    add(&mut s, 2, 10);
    add(&mut s, 3, 5);
    let out = step(&mut s, 51);
    // 1 decode token, then 7 of seq 2's prompt; seq 3 is admitted only once budget remains.
    assert_eq!(summary(&out), vec![(1, 3, 1, true, true), (2, 0, 7, false, false)]);
    assert_eq!(out.batch.tokens[0], 50);
    assert_eq!(out.batch.tokens[1..], (200..207).collect::<Vec<u32>>()[..]);
    assert_eq!(out.batch.positions[0], 3);
    assert_eq!(out.batch.seqs[1].start, 1);
    // Block tables cover exactly what the step touches: 4 positions → 1 block, 7 → 2 blocks.
    assert_eq!(out.batch.seqs[0].block_table.len(), 1);
    assert_eq!(out.batch.seqs[1].block_table.len(), 2);
    assert_eq!(s.num_waiting(), 1);

    let out = step(&mut s, 52);
    assert_eq!(summary(&out), vec![(1, 4, 1, true, true), (2, 7, 3, true, false), (3, 0, 4, false, false)]);
    assert_eq!(out.admitted, vec![Admission { id: 3, cached_tokens: 0, first_time: true }]);
}

#[test]
fn max_num_seqs_caps_running_sequences() {
    let mut s = sched(100, 4, 2, 64);
    for id in 1..=3 {
        add(&mut s, id, 4);
    }
    let out = step(&mut s, 1);
    assert_eq!(out.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    s.remove(1);
    let out = step(&mut s, 1);
    assert_eq!(summary(&out), vec![(2, 4, 1, true, true), (3, 0, 4, true, false)]);
}

#[test]
fn admission_waits_for_blocks_in_fcfs_order() {
    let mut s = sched(4, 4, 8, 64);
    add(&mut s, 1, 12); // 3 blocks
    add(&mut s, 2, 8); // 2 blocks: does not fit
    add(&mut s, 3, 2); // would fit, but must not overtake 2
    let out = step(&mut s, 1);
    assert_eq!(out.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2, 3]);
    s.remove(1);
    assert_eq!(s.kv().num_free_blocks(), 4);
    let out = step(&mut s, 1);
    assert_eq!(out.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![2, 3]);
}

#[test]
fn preemption_takes_the_newest_and_requeues_it_first() {
    // 4 blocks of 2 tokens; three 2-token prompts take one block each.
    let mut s = sched(4, 2, 8, 64);
    for id in 1..=3 {
        add(&mut s, id, 2);
    }
    step(&mut s, 9);
    assert_eq!(s.kv().num_free_blocks(), 1);
    // Each now needs a second block for position 2: seq 1 gets the last free one, seq 2 gets
    // seq 3's (the newest), and seq 3 goes back to waiting with its generated token kept.
    let out = step(&mut s, 10);
    assert_eq!(out.preempted, vec![3]);
    assert_eq!(summary(&out), vec![(1, 2, 1, true, true), (2, 2, 1, true, true)]);
    assert_eq!(s.get(3).unwrap().tokens, vec![300, 301, 9]);
    assert_eq!(s.get(3).unwrap().num_computed, 0);

    // Positions 3 fit; seq 3 cannot be re-admitted yet.
    let out = step(&mut s, 11);
    assert_eq!(summary(&out), vec![(1, 3, 1, true, true), (2, 3, 1, true, true)]);
    // Position 4 needs a third block: seq 2 is now the newest running and goes to the front of the
    // queue, ahead of the younger seq 3.
    let out = step(&mut s, 12);
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(summary(&out), vec![(1, 4, 1, true, true)]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(s.get(2).unwrap().output(), &[9, 10, 11]);

    // Once seq 1 is done, seq 2 recomputes prompt + output (3 blocks); seq 3 (2 blocks) must wait.
    s.remove(1);
    let out = step(&mut s, 13);
    assert!(out.preempted.is_empty());
    assert_eq!(summary(&out), vec![(2, 0, 5, true, false)]);
    assert_eq!(out.admitted, vec![Admission { id: 2, cached_tokens: 0, first_time: false }]);
    assert_eq!(out.batch.tokens, vec![200, 201, 9, 10, 11]);
    assert_eq!(s.get(2).unwrap().output(), &[9, 10, 11, 13]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![3]);
}

#[test]
fn a_sequence_preempts_itself_when_it_is_the_newest() {
    let mut s = sched(3, 2, 8, 64);
    add(&mut s, 1, 2);
    add(&mut s, 2, 2);
    step(&mut s, 5);
    // Seq 1 takes the last free block; seq 2 finds none and is itself the newest.
    let out = step(&mut s, 6);
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(summary(&out), vec![(1, 2, 1, true, true)]);
    assert_eq!(s.running_ids(), &[1]);
    s.remove(1);
    let out = step(&mut s, 7);
    assert_eq!(summary(&out), vec![(2, 0, 3, true, false)]);
    assert_eq!(s.get(2).unwrap().output(), &[5, 7]);
}

#[test]
fn prefix_hits_skip_computed_tokens() {
    let mut s = Scheduler::new(
        SchedulerConfig { max_num_seqs: 8, max_num_batched_tokens: 64, lookahead: true },
        BlockManager::new(16, 4, true),
    );
    let prompt: Vec<u32> = (0..10).collect();
    s.add(Sequence::new(1, prompt.clone()));
    step(&mut s, 1);
    s.add(Sequence::new(2, prompt));
    let out = step(&mut s, 1);
    assert_eq!(out.admitted, vec![Admission { id: 2, cached_tokens: 8, first_time: true }]);
    assert_eq!(summary(&out)[1], (2, 8, 2, true, false));
    assert_eq!(out.batch.seqs[1].block_table[..2], out.batch.seqs[0].block_table[..2]);
}

#[test]
fn choices_wait_for_the_shared_prompt_then_fork_its_blocks() {
    // Prefix caching off: sharing comes from the fork alone.
    let mut s = sched(16, 4, 8, 64);
    let prompt: Vec<u32> = (0..10).collect();
    s.add(Sequence::new(1, prompt.clone()));
    for id in 2..=4 {
        s.add(Sequence { follows: Some(1), ..Sequence::new(id, prompt.clone()) });
    }
    add(&mut s, 9, 3);
    // Step 1: only the first choice computes the prompt; the others (and, FCFS, what queues
    // behind them) wait for it.
    let out = step(&mut s, 50);
    assert_eq!(summary(&out), vec![(1, 0, 10, true, false)]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![2, 3, 4, 9]);
    // Step 2: the choices fork its two full blocks and compute only the partial tail (2 tokens).
    let out = step(&mut s, 51);
    let cached: Vec<(SeqId, usize)> = out.admitted.iter().map(|a| (a.id, a.cached_tokens)).collect();
    assert_eq!(cached, vec![(2, 8), (3, 8), (4, 8), (9, 0)]);
    assert_eq!(summary(&out)[..4], [(1, 10, 1, true, true), (2, 8, 2, true, false), (3, 8, 2, true, false), (4, 8, 2, true, false)]);
    let leader = s.kv().block_table(1).unwrap().to_vec();
    for id in 2..=4 {
        let t = s.kv().block_table(id).unwrap();
        assert_eq!(t[..2], leader[..2], "prompt blocks shared");
        assert_ne!(t[2], leader[2], "the partial block is the choice's own");
    }
    assert_eq!(s.kv().ref_count(leader[0]), 4);
    // 3 (leader) + 1 per choice + 1 (seq 9), instead of 3 per choice.
    assert_eq!(s.kv().num_free_blocks(), 16 - 3 - 3 - 1);
    // A choice whose leader is gone is admitted the usual way.
    s.add(Sequence { follows: Some(77), ..Sequence::new(5, prompt) });
    let out = step(&mut s, 52);
    assert_eq!(out.admitted, vec![Admission { id: 5, cached_tokens: 0, first_time: true }]);
}

#[test]
fn a_requests_choices_take_their_seats_as_a_whole() {
    let mut s = sched(64, 4, 4, 64);
    add(&mut s, 9, 3);
    step(&mut s, 50);
    // Four choices of one prompt (a leader and three followers), then an ordinary request.
    let prompt: Vec<u32> = (0..10).collect();
    s.add(Sequence::new(1, prompt.clone()));
    for id in 2..=4 {
        s.add(Sequence { follows: Some(1), ..Sequence::new(id, prompt.clone()) });
    }
    add(&mut s, 5, 3);
    // 3 seats are free, the choices need 4: none of them starts (the leader alone would hold its
    // blocks with its followers stuck behind), and request 5 does not overtake them.
    let out = step(&mut s, 51);
    assert_eq!(summary(&out), vec![(9, 3, 1, true, true)]);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    // Seat freed: the leader computes the prompt, its followers fork it at the next step, and
    // request 5 waits for a seat.
    s.remove(9);
    let out = step(&mut s, 52);
    assert_eq!(summary(&out), vec![(1, 0, 10, true, false)]);
    let out = step(&mut s, 53);
    assert_eq!(out.admitted.iter().map(|a| (a.id, a.cached_tokens)).collect::<Vec<_>>(), vec![(2, 8), (3, 8), (4, 8)]);
    assert_eq!(s.num_running(), 4);
    assert_eq!(s.waiting_ids().collect::<Vec<_>>(), vec![5]);
}

#[test]
fn the_lookahead_counts_every_choice() {
    // 20 blocks of 4 tokens. Request 9 (8 + up to 24 tokens) runs; then choices of a 7-token
    // prompt that may grow to 23 tokens (6 blocks each at their end, the first one shared).
    let start = |followers: u64| {
        let mut s = sched(20, 4, 8, 64);
        s.add(Sequence { max_len: Some(32), ..Sequence::new(9, (0..8).collect()) });
        step(&mut s, 50);
        s.add(Sequence { max_len: Some(23), ..Sequence::new(1, (100..107).collect()) });
        for id in 2..2 + followers {
            s.add(Sequence { follows: Some(1), max_len: Some(23), ..Sequence::new(id, (100..107).collect()) });
        }
        s
    };
    let mut alone = start(0);
    assert_eq!(step(&mut alone, 51).admitted.len(), 1);
    // Alone, the leader's 2 blocks (6 at its end) fit beside request 9's; with its two followers
    // counted in, they would not: the choices wait, together.
    let mut s = start(2);
    let out = step(&mut s, 51);
    assert!(out.admitted.is_empty(), "{:?}", out.admitted);
    // Once request 9 ends, all three fit and start.
    s.remove(9);
    step(&mut s, 52);
    let out = step(&mut s, 53);
    assert_eq!(out.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), vec![2, 3]);
}
