package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"math"
	"slices"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// requestDigest is what the keys a call derives know of its proto request:
// the SHA-256 of a canonical encoding of it. That encoding is itself a
// valid encoding of the request as the request comparison (Fingerprint)
// reads it: its deterministic encoding with, at every level of a message
// the schema declares, the fields in the order of their numbers (the
// elements of one repeated field keep theirs), and the message a
// google.protobuf.Any packs decoded and encoded again the same way when
// its type is linked in. What the comparison does not tell apart is
// written one way (see canonicalScalar): a singular scalar outside a real
// oneof set to its default is left out, as if unset; -0 is 0 and every
// NaN one;
// the type URL of an Any whose type is linked in is written with the
// prefix type.googleapis.com/. Nothing else is added or left out, so two
// requests the engine tells apart have different encodings, and different
// digests, and two it calls the same have one (but for unknown fields,
// below).
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
// Unknown fields are the exception: the comparison leaves them out (this
// build cannot read them), and the digest keeps them, so that the keys do
// not change when a deploy declares them.
//
// It is taken before the handler runs: the handler may change its request.
// Under version 2 of the derivation (WithDerivedKeyVersion), it is taken
// as the release before took it: nothing written one way.
func requestDigest(req proto.Message, version int) [sha256.Size]byte {
	d := digesters.Get().(*digester)
	defer digesters.Put(d)
	d.asCompared = version >= 3
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
	buf     []byte           // the request's deterministic encoding
	arena   []byte           // the canonical encodings of fields and levels
	spans   []canonicalField // the fields of the levels being read
	scratch []byte           // a field written again (see canonicalScalar)
	// asCompared: what the comparison does not tell apart is written one
	// way (version 3 of the derivation).
	asCompared bool
}

// canonicalField is one field of a level, its canonical encoding in the arena.
type canonicalField struct {
	num      protowire.Number
	from, to int
}

// The fields of google.protobuf.Any (see canonical), and the prefix of
// its type URL as Go's anypb.New writes it.
const (
	anyFullName                    = "google.protobuf.Any"
	anyURLField   protowire.Number = 1
	anyValueField protowire.Number = 2
	anyURLPrefix                   = "type.googleapis.com/"
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
	var plan *msgPlan // the comparison's, when fields are written as it reads them
	if d.asCompared && !md.IsMapEntry() {
		plan = planOf(md)
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
		fd := md.Fields().ByNumber(num)
		if fd != nil && fd.Message() != nil {
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
		switch {
		case !d.asCompared:
		case packed != nil && num == anyURLField:
			// The comparison reads an Any by the type it packs, whatever
			// its URL's prefix.
			d.scratch = protowire.AppendString(protowire.AppendTag(d.scratch[:0], num, protowire.BytesType), anyURLPrefix+string(packed.Descriptor().FullName()))
			field = d.scratch
		case fd != nil && fd.Message() == nil:
			zeroAbsent := plan != nil && plan.fields[fd.Index()].zeroAbsent
			written, keep := canonicalScalar(d.scratch[:0], fd, zeroAbsent, field, n, typ)
			if !keep {
				continue
			}
			if written != nil {
				d.scratch, field = written, written
			}
		}
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

// canonicalScalar writes field, a declared scalar field fd whose tag is n
// bytes long, as the request comparison (Fingerprint) reads it, and
// reports false when it is left out: a singular field outside a real
// oneof (zeroAbsent, the comparison's fieldPlan; never the key or value of
// a map entry, which the encoding always writes) set to its default
// (isDefault), which the comparison counts as absent, as the
// deterministic encoding leaves out such a field without presence. A
// float or double is written as floatBits reads it: -0 as 0, every NaN as
// one, each element of a packed list too. A field already written so is
// not written again: written is nil; another is written into dst.
func canonicalScalar(dst []byte, fd protoreflect.FieldDescriptor, zeroAbsent bool, field []byte, n int, typ protowire.Type) (written []byte, keep bool) {
	v := field[n:]
	if k := fd.Kind(); k == protoreflect.DoubleKind || k == protoreflect.FloatKind {
		size := 8
		if k == protoreflect.FloatKind {
			size = 4
		}
		list, m := protowire.ConsumeBytes(v)
		switch {
		case typ == protowire.BytesType && m == len(v) && len(list)%size == 0: // a packed list
			if canonicalFloats(list, size) {
				return nil, true
			}
			dst = protowire.AppendVarint(append(dst, field[:n]...), uint64(len(list)))
			for i := 0; i < len(list); i += size {
				dst = appendCanonicalFloat(dst, list[i:i+size])
			}
			return dst, true
		case len(v) == size && !canonicalFloats(v, size):
			written = appendCanonicalFloat(append(dst, field[:n]...), v)
			v = written[n:]
		}
	}
	switch k := fd.Kind(); {
	case !zeroAbsent:
		return written, true
	case !fd.HasPresence() && k != protoreflect.DoubleKind && k != protoreflect.FloatKind:
		return written, true // the encoding leaves its default out
	case typ == protowire.BytesType && k == protoreflect.StringKind:
		b, m := protowire.ConsumeBytes(v)
		return written, m != len(v) || string(b) != fd.Default().String() // as isDefault, without a copy
	}
	x, ok := scalarValue(fd, typ, v)
	return written, !ok || !isDefault(fd, x)
}

// canonicalFloats reports whether each float (size 4) or double (size 8)
// of list, little-endian, is written as floatBits reads it.
func canonicalFloats(list []byte, size int) bool {
	var b [8]byte
	for i := 0; i+size <= len(list); i += size {
		if !bytes.Equal(appendCanonicalFloat(b[:0], list[i:i+size]), list[i:i+size]) {
			return false
		}
	}
	return true
}

// appendCanonicalFloat appends the float (4 bytes) or double (8) x,
// little-endian, as floatBits reads it: -0 as 0, every NaN as Go's
// math.NaN().
func appendCanonicalFloat(dst, x []byte) []byte {
	if len(x) == 4 {
		f := math.Float32frombits(binary.LittleEndian.Uint32(x))
		switch {
		case f != f:
			f = float32(math.NaN())
		case f == 0:
			f = 0
		}
		return binary.LittleEndian.AppendUint32(dst, math.Float32bits(f))
	}
	return binary.LittleEndian.AppendUint64(dst, floatBits(math.Float64frombits(binary.LittleEndian.Uint64(x))))
}

// scalarValue decodes v, the value of the singular scalar field fd
// encoded with typ, and false when it does not decode as fd's kind.
func scalarValue(fd protoreflect.FieldDescriptor, typ protowire.Type, v []byte) (protoreflect.Value, bool) {
	var x uint64
	var m int
	switch typ {
	case protowire.VarintType:
		x, m = protowire.ConsumeVarint(v)
	case protowire.Fixed32Type:
		var x32 uint32
		x32, m = protowire.ConsumeFixed32(v)
		x = uint64(x32)
	case protowire.Fixed64Type:
		x, m = protowire.ConsumeFixed64(v)
	case protowire.BytesType:
		var b []byte
		b, m = protowire.ConsumeBytes(v)
		if m == len(v) {
			switch fd.Kind() {
			case protoreflect.BytesKind:
				return protoreflect.ValueOfBytes(b), true
			}
		}
		return protoreflect.Value{}, false
	}
	if m != len(v) || m <= 0 {
		return protoreflect.Value{}, false
	}
	switch k := fd.Kind(); {
	case typ == protowire.VarintType && k == protoreflect.BoolKind:
		return protoreflect.ValueOfBool(x != 0), true
	case typ == protowire.VarintType && k == protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(protoreflect.EnumNumber(int32(x))), true
	case typ == protowire.VarintType && k == protoreflect.Int32Kind:
		return protoreflect.ValueOfInt32(int32(x)), true
	case typ == protowire.VarintType && k == protoreflect.Int64Kind:
		return protoreflect.ValueOfInt64(int64(x)), true
	case typ == protowire.VarintType && k == protoreflect.Sint32Kind:
		return protoreflect.ValueOfInt32(int32(protowire.DecodeZigZag(x & math.MaxUint32))), true
	case typ == protowire.VarintType && k == protoreflect.Sint64Kind:
		return protoreflect.ValueOfInt64(protowire.DecodeZigZag(x)), true
	case typ == protowire.VarintType && k == protoreflect.Uint32Kind:
		return protoreflect.ValueOfUint32(uint32(x)), true
	case typ == protowire.VarintType && k == protoreflect.Uint64Kind:
		return protoreflect.ValueOfUint64(x), true
	case typ == protowire.Fixed32Type && k == protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(x)), true
	case typ == protowire.Fixed32Type && k == protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(x)), true
	case typ == protowire.Fixed32Type && k == protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(math.Float32frombits(uint32(x))), true
	case typ == protowire.Fixed64Type && k == protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(x), true
	case typ == protowire.Fixed64Type && k == protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(int64(x)), true
	case typ == protowire.Fixed64Type && k == protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(math.Float64frombits(x)), true
	}
	return protoreflect.Value{}, false
}
