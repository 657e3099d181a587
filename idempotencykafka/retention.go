package idempotencykafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// retention is what the consumer knows of how long Kafka may deliver a
// topic's records again: the TTL each topic's IDs are kept for.
type retention struct {
	mu        sync.Mutex
	offsets   time.Duration        // the brokers' offsets.retention.minutes
	offsetsAt time.Time            // when offsets was read; zero until then
	checkedAt time.Time            // when Run last looked at every topic's (see recheckRetention)
	topics    map[string]*topicTTL // by topic
}

// topicTTL is one topic's TTL and when its configs were read; its lock is
// held while they are read, so that one topic's slow read holds up that
// topic's records only.
type topicTTL struct {
	mu     sync.Mutex
	ttl    time.Duration
	readAt time.Time // zero until read
}

// offsetsUnknown is the brokers' offsets.retention.minutes when the client
// may not read it and WithTTL stands for it.
const offsetsUnknown time.Duration = 0

// retentionRefresh is how long configs read stay the consumer's word: an
// operator may raise a topic's retention.ms at any time, and no TTL is
// computed from configs read longer ago than this (Run reads them again
// between polls, a record before it is applied).
const retentionRefresh = time.Minute

// fresh reports whether configs read at readAt may still be used at now.
func fresh(readAt, now time.Time) bool {
	return !readAt.IsZero() && now.Sub(readAt) < retentionRefresh
}

// CheckRetention makes sure that the IDs of every topic the client
// consumes now outlast what Kafka keeps: a record is never read again
// after its ID was forgotten. Run calls it when it starts; a poll loop of
// one's own ([Consumer.ProcessFetches]) may call it before its first poll
// to fail early. Topics met later (matched by a regex, added to the
// client) are checked when their first records arrive, before any is
// applied, and by [Consumer.Message].
//
// A topic's records may come again for its retention.ms and segment.ms (a
// segment is deleted once its newest record is past retention) plus the
// brokers' offsets.retention.minutes (a group whose offsets expire reads
// its topics from the start). A record stamped ahead of the consumer's
// clock (a producer's clock ahead, a timestamp it set) is kept that much
// longer, and its ID with it ([Consumer.Message]); the records beside it
// in its segment are kept as long, which their IDs cannot foresee: give a
// topic whose producers may stamp records ahead message.timestamp.type
// LogAppendTime (the broker stamps them), or bound how far ahead with
// message.timestamp.after.max.ms and leave that much room in WithTTL. Without [WithTTL] that sum is the TTL of the topic's
// IDs; with it, a shorter TTL is refused, naming both. A topic that keeps
// its records forever (retention.ms -1, or cleanup.policy compact without
// delete) needs an explicit TTL, the operator's decision. A topic's dead
// letters are its records (read back, they are identified as such), so its
// IDs outlast its dead-letter topic's retention too, while that topic
// exists (its configs failing to be read are waited for, as the topic's
// own are). Configs the
// client is not authorized to read are an error without WithTTL, and
// WithTTL stands for them with it, still held to those it may read (a
// client that may describe its topics but not the brokers has WithTTL
// refused when it is shorter than a topic's retention.ms and segment.ms);
// a read that fails for another reason is tried again (Run waits for it,
// and a record waits for its topic's).
//
// Retention changes while the consumer runs: the configs are read again
// once they are a minute old, by Run between polls and before a record's
// TTL is computed from them, so that a record is never given the TTL of a
// retention.ms raised since. A WithTTL that a raise makes too short is
// refused then as it is at the start: Run returns the refusal, and no
// record of the topic is applied with it. IDs stored before a raise keep
// the TTL they were given, which the records produced before it may now
// outlive: give a topic whose retention may be raised a WithTTL with room
// for the raise.
func (c *Consumer) CheckRetention(ctx context.Context) error {
	topics := c.client.GetConsumeTopics()
	if regex, _ := c.client.OptValue(kgo.ConsumeRegex).(bool); !regex {
		named, _ := c.client.OptValue(kgo.ConsumeTopics).([]string)
		topics = append(topics, named...)
	}
	slices.Sort(topics)
	for _, topic := range slices.Compact(topics) {
		if _, err := c.ttlOf(ctx, topic); err != nil {
			return err
		}
	}
	return nil
}

// recheckRetention is Run's CheckRetention between polls, once per
// retentionRefresh: the configs read a refresh ago are read again (a
// retention raised meanwhile) between polls rather than in one, and a
// topic without records (a WithTTL that a raise made too short, a topic
// deleted) is reported once per refresh, not per poll. The error is a
// refusal, Run's to return; a read that may pass is reported, and the
// records of its topic wait for it.
func (c *Consumer) recheckRetention(ctx context.Context) error {
	now := c.o.now()
	c.ret.mu.Lock()
	due := !fresh(c.ret.checkedAt, now)
	if due {
		c.ret.checkedAt = now
	}
	c.ret.mu.Unlock()
	if !due {
		return nil
	}
	err := c.CheckRetention(ctx)
	switch {
	case err == nil || ctx.Err() != nil:
		return nil
	case c.permanent(err):
		return err
	}
	c.o.onError(fmt.Errorf("%w; trying again", err))
	return nil
}

// ttlOf returns how long the IDs of topic's records are kept, reading the
// topic's and the brokers' configs when they were not read within
// retentionRefresh. An error is the operator's to fix (a TTL too short,
// configs the client may not read without WithTTL), or a failure to read
// them that may pass: nothing is kept of it, and the next call reads them
// again; the TTL read before is not used past its time.
func (c *Consumer) ttlOf(ctx context.Context, topic string) (time.Duration, error) {
	c.ret.mu.Lock()
	e := c.ret.topics[topic]
	if e == nil {
		e = &topicTTL{}
		c.ret.topics[topic] = e
	}
	c.ret.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	now := c.o.now()
	if fresh(e.readAt, now) {
		return e.ttl, nil
	}
	ttl, err := c.readTTL(ctx, topic, now)
	if err != nil {
		if !c.o.ttlSet || !notAuthorized(err) {
			return 0, err
		}
		// The client may not read the configs, for good: the operator's
		// WithTTL is the TTL.
		c.o.onError(fmt.Errorf("%w; going on with WithTTL(%v)", err, c.o.ttl))
		ttl = c.o.ttl
	}
	e.ttl, e.readAt = ttl, now
	return ttl, nil
}

// errRefused marks a TTL the configs show to be too short.
var errRefused = errors.New("idempotencykafka: the TTL of message IDs is too short")

// permanent reports whether a TTL error is the operator's to fix: no retry
// of the read helps.
func (c *Consumer) permanent(err error) bool {
	return errors.Is(err, errRefused) || notAuthorized(err)
}

// notAuthorized reports whether err says the client may not read configs.
func notAuthorized(err error) bool {
	return errors.Is(err, kerr.ClusterAuthorizationFailed) || errors.Is(err, kerr.TopicAuthorizationFailed)
}

// readTTL reads topic's configs, and the brokers' when they were not read
// within retentionRefresh, at now.
func (c *Consumer) readTTL(ctx context.Context, topic string, now time.Time) (time.Duration, error) {
	adm := kadm.NewClient(c.client)
	c.ret.mu.Lock()
	offsets, offsetsAt := c.ret.offsets, c.ret.offsetsAt
	c.ret.mu.Unlock()
	if !fresh(offsetsAt, now) {
		var err error
		if offsets, err = brokersOffsetsRetention(ctx, adm); err != nil {
			if !c.o.ttlSet || !notAuthorized(err) {
				return 0, c.retentionUnknown(err)
			}
			// The client may not read the brokers' configs: WithTTL
			// stands for their offsets.retention.minutes, and is still
			// held to the topic's retention, which it may read.
			c.o.onError(fmt.Errorf("%w; WithTTL(%v) stands for the brokers' offsets.retention.minutes", c.retentionUnknown(err), c.o.ttl))
			offsets = offsetsUnknown
		}
		c.ret.mu.Lock()
		c.ret.offsets, c.ret.offsetsAt = offsets, now
		c.ret.mu.Unlock()
	}
	// The topic's dead letters are its records too (a consumer of the
	// dead-letter topic identifies them as such): their IDs outlast the
	// dead-letter topic's retention as well, when it exists. Its configs
	// failing to be read fail the read as the topic's own do.
	topics := []string{topic}
	if dlt := c.o.deadLetterTopic(topic); validTopic(dlt) && dlt != topic {
		topics = append(topics, dlt)
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, topics...)
	if err == nil {
		if own, onErr := rcs.On(topic, nil); onErr != nil {
			err = onErr
		} else {
			err = firstErr(kadm.ResourceConfigs{own})
		}
	}
	if err != nil {
		return 0, c.retentionUnknown(err)
	}
	var ttl time.Duration
	for _, rc := range rcs {
		switch {
		case rc.Err == nil:
		case errors.Is(rc.Err, kerr.UnknownTopicOrPartition):
			continue // no dead-letter topic (yet)
		default:
			// A timeout, a broker's failure: the dead-letter topic's
			// retention is unknown, not absent.
			return 0, c.retentionUnknown(fmt.Errorf("%s: %w", rc.Name, rc.Err))
		}
		d, err := c.ttlFor(kadm.ResourceConfigs{rc}, offsets)
		if err != nil {
			return 0, err
		}
		ttl = max(ttl, d)
	}
	return ttl, nil
}

// ttlFor is the TTL of the IDs of one topic, of configs rc.
func (c *Consumer) ttlFor(rc kadm.ResourceConfigs, offsets time.Duration) (time.Duration, error) {
	topic := rc[0].Name
	retention, ok := configMillis(rc, "retention.ms", time.Millisecond)
	if !ok {
		retention = 7 * 24 * time.Hour // Kafka's default
	}
	// Kafka deletes a segment once its newest record is past retention.ms:
	// a segment's oldest record is there for up to segment.ms longer.
	segment, ok := configMillis(rc, "segment.ms", time.Millisecond)
	if !ok || segment < 0 {
		segment = 7 * 24 * time.Hour // Kafka's default
	}
	policy := configValue(rc, "cleanup.policy")
	forever := retention < 0 || strings.Contains(policy, "compact") && !strings.Contains(policy, "delete")
	need := retention + segment + offsets
	switch {
	case forever && !c.o.ttlSet:
		return 0, fmt.Errorf("%w: topic %s keeps its records forever (retention.ms %v, cleanup.policy %q): no TTL of message IDs outlasts it; "+
			"choose one with WithTTL (records read again after it are applied again)", errRefused, topic, retention, policy)
	case forever:
		return c.o.ttl, nil
	case !c.o.ttlSet:
		return need, nil
	case c.o.ttl < need && offsets == offsetsUnknown:
		return 0, fmt.Errorf("%w: WithTTL(%v) is shorter than topic %s's retention.ms (%v) and segment.ms (%v), to which the brokers' offsets.retention.minutes (which the client may not read) add: "+
			"a group whose offsets expire re-reads records whose IDs are forgotten and applies them again; set more than %v",
			errRefused, c.o.ttl, topic, retention, segment, need)
	case c.o.ttl < need:
		return 0, fmt.Errorf("%w: WithTTL(%v) is shorter than topic %s's retention.ms (%v) and segment.ms (%v) plus the brokers' offsets.retention.minutes (%v): "+
			"a group whose offsets expire re-reads records whose IDs are forgotten and applies them again; set at least %v",
			errRefused, c.o.ttl, topic, retention, segment, offsets, need)
	}
	return c.o.ttl, nil
}

// brokersOffsetsRetention reads offsets.retention.minutes from a broker's
// own configs (the cluster's default resource holds dynamic ones only).
func brokersOffsetsRetention(ctx context.Context, adm *kadm.Client) (time.Duration, error) {
	brokers, err := adm.ListBrokers(ctx)
	if err != nil {
		return 0, err
	}
	if len(brokers) == 0 {
		return 0, errors.New("no broker listed")
	}
	rcs, err := adm.DescribeBrokerConfigs(ctx, brokers[0].NodeID)
	if err == nil {
		err = firstErr(rcs)
	}
	if err != nil {
		return 0, err
	}
	if d, ok := configMillis(rcs, "offsets.retention.minutes", time.Minute); ok && d > 0 {
		return d, nil
	}
	return 7 * 24 * time.Hour, nil // Kafka's default
}

// firstErr is the first error of a resource's configs.
func firstErr(rcs kadm.ResourceConfigs) error {
	for _, rc := range rcs {
		if rc.Err != nil {
			return fmt.Errorf("%s: %w", rc.Name, rc.Err)
		}
	}
	return nil
}

// retentionUnknown is the error of a retention that cannot be read.
func (c *Consumer) retentionUnknown(err error) error {
	return fmt.Errorf("idempotencykafka: the topics' retention.ms and the brokers' offsets.retention.minutes cannot be read (%w): "+
		"if the client may not (DescribeConfigs), grant it, or set WithTTL longer than both together", err)
}

// configValue returns a config's value, "" when absent.
func configValue(rcs kadm.ResourceConfigs, key string) string {
	for _, rc := range rcs {
		for _, cfg := range rc.Configs {
			if cfg.Key == key && cfg.Value != nil {
				return *cfg.Value
			}
		}
	}
	return ""
}

// configMillis returns a config's value as a duration of unit, -1 for a
// negative value (forever).
func configMillis(rcs kadm.ResourceConfigs, key string, unit time.Duration) (time.Duration, bool) {
	v := configValue(rcs, key)
	if v == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, false
	}
	if n < 0 {
		return -1, true
	}
	return time.Duration(n) * unit, true
}
