package idempotency

import (
	"cmp"
	"crypto/sha256"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// requestDigest is what the keys a call derives know of its proto request:
// the SHA-256 of a canonical encoding of it. That encoding is itself a
// valid encoding of the request: its deterministic encoding with, at every
// level of a message the schema declares, the fields in the order of
// their numbers (the elements of one repeated field keep theirs), and the
// message a google.protobuf.Any packs decoded and encoded again the same
// way when its type is linked in. Nothing else is added, so two requests
// the engine tells apart have different encodings, and different digests.
//
// The encoding writes declared fields in number order and unknown ones
// after them, as received; ordering both makes a field this build
// declares and the same field held as unknown by a build that did not
// declare it (a scalar, or a message the client encoded in number order,
// as encoders do) canonical alike. So the same request derives the same
// keys from any client and across a deploy that declares a field between
// a call's crash and its re-run. What a build reads differently from how
// the client sent it is not made alike: a proto3 list sent unpacked, an
// explicit zero of a field without presence, a map held as unknown (its
// entries in the client's order), an Any whose type is not linked in.
//
// It is taken before the handler runs: the handler may change its request.
func requestDigest(req proto.Message) [sha256.Size]byte {
	d := digesters.Get().(*digester)
	defer digesters.Put(d)
	b, err := proto.MarshalOptions{Deterministic: true, AllowPartial: true}.MarshalAppend(d.buf[:0], req)
	d.buf = b[:0]
	if err == nil {
		d.arena = d.arena[:0]
		if from, to, ok := d.canonical(b, req.ProtoReflect().Descriptor(), 0); ok {
			return sha256.Sum256(d.arena[from:to])
		}
	}
	// Bytes that do not parse (they always do) or a request that does not
	// marshal (then its fingerprint failed before): the encoding as it is.
	return sha256.Sum256(b)
}

var digesters = sync.Pool{New: func() any { return new(digester) }}

// digester is the scratch space of requestDigest, kept between calls.
type digester struct {
	buf   []byte           // the request's deterministic encoding
	arena []byte           // the canonical encodings of fields and levels
	spans []canonicalField // the fields of the levels being read
}

// canonicalField is one field of a level, its canonical encoding in the arena.
type canonicalField struct {
	num      protowire.Number
	from, to int
}

// The fields of google.protobuf.Any (see canonical).
const (
	anyFullName                    = "google.protobuf.Any"
	anyURLField   protowire.Number = 1
	anyValueField protowire.Number = 2
)

// maxDigestDepth bounds the levels read as messages; deeper ones are kept
// as their bytes.
const maxDigestDepth = 64

// canonical appends to the arena the canonical encoding of the message md
// encoded in b, and returns where it is.
func (d *digester) canonical(b []byte, md protoreflect.MessageDescriptor, depth int) (from, to int, ok bool) {
	start := len(d.spans)
	defer func() { d.spans = d.spans[:start] }()
	var packed protoreflect.MessageType // what an Any packs, when linked in
	if md.FullName() == anyFullName {
		packed = anyPacked(b)
	}
	for pos := 0; pos < len(b); {
		num, typ, n := protowire.ConsumeTag(b[pos:])
		if n < 0 {
			return 0, 0, false
		}
		m := protowire.ConsumeFieldValue(num, typ, b[pos+n:])
		if m < 0 {
			return 0, 0, false
		}
		field := b[pos : pos+n+m]
		pos += n + m
		var sub protoreflect.MessageDescriptor
		value, _ := protowire.ConsumeBytes(field[n:])
		if fd := md.Fields().ByNumber(num); fd != nil && fd.Message() != nil {
			sub = fd.Message()
		} else if packed != nil && num == anyValueField {
			// The client's bytes are not its deterministic encoding: the
			// packed message is decoded (the last of a oneof's members or of
			// a map's entries under one key wins) and encoded again.
			msg := packed.New().Interface()
			if err := (proto.UnmarshalOptions{AllowPartial: true}).Unmarshal(value, msg); err == nil {
				if re, err := (proto.MarshalOptions{Deterministic: true, AllowPartial: true}).Marshal(msg); err == nil {
					value, sub = re, packed.Descriptor()
				}
			}
		}
		f := canonicalField{num: num}
		if sub != nil && typ == protowire.BytesType && depth < maxDigestDepth {
			vf, vt, ok := d.canonical(value, sub, depth+1)
			if !ok {
				return 0, 0, false
			}
			f.from = len(d.arena) // after what the level below wrote
			d.arena = protowire.AppendTag(d.arena, num, protowire.BytesType)
			d.arena = protowire.AppendBytes(d.arena, d.arena[vf:vt])
		} else {
			f.from = len(d.arena)
			d.arena = append(d.arena, field...)
		}
		f.to = len(d.arena)
		d.spans = append(d.spans, f)
	}
	fields := d.spans[start:]
	slices.SortStableFunc(fields, func(x, y canonicalField) int { return cmp.Compare(x.num, y.num) })
	from = len(d.arena)
	for _, f := range fields {
		d.arena = append(d.arena, d.arena[f.from:f.to]...)
	}
	return from, len(d.arena), true
}

// anyPacked is the type of the message the Any encoded in b packs (its
// last type_url, as a decoder reads it), nil when it is not linked in.
func anyPacked(b []byte) protoreflect.MessageType {
	var url []byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return nil
		}
		if num == anyURLField && typ == protowire.BytesType {
			url, _ = protowire.ConsumeBytes(b[n:])
		}
		b = b[n+m:]
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByURL(string(url))
	if err != nil {
		return nil
	}
	return mt
}
